"""GRPO's (and DAPO's, Dr. GRPO's) numbers over the global batch, from per-token log-probs: no model is run here.

Owns: `GRPOConfig` (the clip range, the KL coefficient, the normalisation and reward-scaling switches, checked
when built), `GRPOBatch` (a rollout batch prepared once: advantages, old and reference log-probs, global counts),
the rollout batch's check (`check_rollouts`: whole groups of consecutive rows, one reward per row),
`group_advantages`, the per-token terms summed per completion (`token_terms`), a replica's share of the global
loss (`replica_share`) and the logged metrics (`grpo_metrics`). grpo.py and grpo_pipeline.py run the model.

The numbers, as one process computes them, with i a completion, t one of its response tokens, G completions per
prompt, r_i its reward, ratio = exp(logp_new - logp_old), eps_low / eps_high the clip range (eps_high > eps_low:
DAPO's clip-higher):
- advantage A_i = (r_i - mean of its group) / (std + 1e-4); std: of its group ("group", GRPO; unbiased, as TRL),
  of the whole global batch ("batch": every replica's rewards), or none, A_i = r_i - mean ("none", Dr. GRPO).
  A group lives on one replica (refused otherwise), so its mean and std need no other replica's rewards.
- per token l_it = -min(ratio A_i, clip(ratio, 1 - eps_low, 1 + eps_high) A_i) + beta k3_it, with the k3 estimator
  of KL(policy || reference) k3 = exp(ref - new) - (ref - new) - 1;
- loss: "token" (DAPO, GRPO as TRL): sum_it l_it / the global batch's response tokens; "sequence" (original GRPO):
  the mean over completions of each completion's token mean; "constant" (Dr. GRPO): sum_it l_it / (completions x
  max_length);
- each replica returns its share, sum_local x dp / the global count, so the gradients' average over dp (x cp) is
  the gradient of the global loss; under cp each rank's per-completion sums are summed over cp with an exact
  adjoint (`sum_over_context`), as `sequence_logprobs` does.
Logged (global, equal on every rank): loss, reward/mean, reward/std, kl, clip_fraction (tokens whose clipped term
was taken), entropy (per response token), response_length (tokens per completion).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshboost.distributed import comm
from meshboost.post_training.logprobs import TokenLogprobs, sum_over_context
from meshboost.post_training.objectives import GlobalBatch
from meshboost.post_training.rollout import RolloutBatch

NORMALIZATIONS = ("token", "sequence", "constant")
REWARD_SCALES = ("group", "batch", "none")
STD_EPS = 1e-4
METRICS = ("loss", "reward/mean", "reward/std", "kl", "clip_fraction", "entropy", "response_length")


@dataclass(frozen=True)
class GRPOConfig:
    epsilon_low: float = 0.2           # the ratio is clipped below at 1 - epsilon_low
    epsilon_high: float | None = None  # ... and above at 1 + epsilon_high (None: epsilon_low; DAPO: 0.28)
    beta: float = 0.0                  # the k3 KL penalty's coefficient (0: no reference needed)
    normalization: str = "token"       # "token" (DAPO), "sequence" (GRPO), "constant" (Dr. GRPO: max_length)
    max_length: int | None = None      # "constant": the per-completion divisor (the generation budget)
    scale_rewards: str = "group"       # the advantage's std: "group", "batch" (global), "none" (Dr. GRPO)
    log_entropy: bool = True           # the entropy metric (False: NaN; a chunked head then keeps its chunks)

    def __post_init__(self):
        high = self.epsilon_low if self.epsilon_high is None else self.epsilon_high
        if not (0 <= self.epsilon_low < 1 and high >= 0):
            raise ValueError(f"epsilon_low={self.epsilon_low}, epsilon_high={self.epsilon_high}: the clip range is "
                             "[1 - epsilon_low, 1 + epsilon_high], 0 <= epsilon_low < 1, epsilon_high >= 0")
        if self.beta < 0:
            raise ValueError(f"beta={self.beta}: the KL coefficient is >= 0")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}: one of {NORMALIZATIONS}")
        if (self.normalization == "constant") != (self.max_length is not None):
            raise ValueError(f"normalization={self.normalization!r} with max_length={self.max_length}: max_length "
                             "(the generation budget, e.g. max_new_tokens) is the divisor of 'constant' only")
        if self.max_length is not None and not self.max_length >= 1:
            raise ValueError(f"max_length={self.max_length}: at least 1")
        if self.scale_rewards not in REWARD_SCALES:
            raise ValueError(f"scale_rewards={self.scale_rewards!r}: one of {REWARD_SCALES}")

    @property
    def clip_range(self) -> tuple[float, float]:
        high = self.epsilon_low if self.epsilon_high is None else self.epsilon_high
        return 1.0 - self.epsilon_low, 1.0 + high


class GRPOBatchError(ValueError):
    """A rollout batch GRPO cannot score exactly (raised on every rank)."""


@dataclass(frozen=True)
class GRPOBatch:
    """A rollout batch prepared once (`prepare_grpo`), reused by every optimisation step on it."""

    rollout: RolloutBatch
    rewards: torch.Tensor              # [N] this replica's rewards
    advantages: torch.Tensor           # [N]
    old_logprobs: torch.Tensor         # [N, S_here] the policy's at preparation (no gradient), where it scores
    ref_logprobs: torch.Tensor | None  # [N, S_here] the reference's (beta > 0)
    sequences: torch.Tensor            # the global batch's completions
    tokens: torch.Tensor               # the global batch's response tokens
    reward_stats: tuple[float, float]  # global reward mean and std


@dataclass(frozen=True)
class GRPOOutput:
    loss: torch.Tensor                 # this replica's share (already backwarded by grpo_step); global in metrics
    metrics: dict[str, float]


def check_rollouts(rollout, rewards) -> str | None:
    """What makes `rollout` and `rewards` unscorable, or None (pure: the caller agrees it over every rank)."""
    if not isinstance(rollout, RolloutBatch):
        return f"a GRPO batch is a RolloutBatch (generate_rollouts); got {type(rollout).__name__}"
    n, g = rollout.rows, rollout.group_size
    if g < 2:
        return f"group_size={g}: a group-relative advantage needs at least 2 completions per prompt"
    if not torch.is_tensor(rewards) or rewards.dim() != 1 or rewards.shape[0] != n:
        shape = tuple(rewards.shape) if torch.is_tensor(rewards) else type(rewards).__name__
        return f"rewards {shape}: one float per completion, shape ({n},) for this replica's {n} rows"
    if n == 0 or n % g:
        return (f"{n} rows with group_size={g}: every replica holds whole groups (a multiple of {g} rows; a group "
                "split across replicas would give its completions other advantages)")
    lengths, starts = rollout.response_mask.sum(dim=1), rollout.response_mask[:, 0]
    if (lengths == 0).any() or starts.any():
        row = int(((lengths == 0) | starts).nonzero()[0])
        return (f"row {row} holds no completion token, or one at position 0 (no prompt token before it to score "
                "it from): every completion follows a prompt of at least one token and has at least one token")
    prompts = rollout.input_ids.masked_fill(rollout.response_mask | (rollout.attention_mask == 0), -1)
    grouped = prompts.view(n // g, g, -1)
    split = (grouped != grouped[:, :1]).any(dim=2).any(dim=1).nonzero().flatten().tolist()
    if split:
        first = split[0] * g
        return (f"rows {first}..{first + g - 1} should be one prompt's {g} completions but hold different prompts: "
                "a group split across replicas or reordered; give each replica whole groups, consecutive rows")
    if not torch.isfinite(rewards).all():
        return "rewards hold NaN or infinity"
    return None


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", group=None) -> torch.Tensor:
    """A_i = (r_i - its group's mean) / (std + 1e-4): the group's std ("group"), the global batch's ("batch", over
    the data-parallel `group`), or no division ("none")."""
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred.flatten()
    if scale == "group":
        std = r.std(dim=1, keepdim=True)
    else:
        n, s, s2 = GlobalBatch(group).totals(torch.tensor(float(r.numel()), device=r.device), r, r * r)
        std = ((s2 - s * s / n) / (n - 1)).clamp(min=0).sqrt()
    return (centred / (std + STD_EPS)).flatten()


@dataclass(frozen=True)
class TokenTerms:
    """Per-completion sums of one forward's per-token terms (summed over cp): what the loss and metrics read."""

    loss: torch.Tensor        # [B] sum of l_it (differentiable)
    counts: torch.Tensor      # [B] response tokens
    kl: torch.Tensor          # [B] sum of k3 (detached)
    clipped: torch.Tensor     # [B] tokens whose clipped term was taken
    entropy: torch.Tensor     # [B] sum of the entropies (0 when not asked for)
    logged_entropy: bool = True


def token_terms(tokens: TokenLogprobs, old: torch.Tensor, ref: torch.Tensor | None, advantages: torch.Tensor,
                config: GRPOConfig, cp_group=None) -> TokenTerms:
    """The per-token GRPO terms of `tokens` (this forward's log-probs), summed per completion."""
    mask = tokens.mask.float()
    new = tokens.logprobs
    low, high = config.clip_range
    a = advantages.to(new.device).unsqueeze(1)
    ratio = torch.exp(new - old)
    unclipped, clipped = ratio * a, torch.clamp(ratio, low, high) * a
    per_token = -torch.minimum(unclipped, clipped)
    kl = torch.zeros_like(new)
    if ref is not None:
        d = ref - new
        kl = torch.exp(d) - d - 1
        per_token = per_token + config.beta * kl
    took_clip = ((ratio < low) & (a < 0)) | ((ratio > high) & (a > 0))
    ent = tokens.entropy if tokens.entropy is not None else torch.zeros_like(new)
    loss = (per_token * mask).sum(dim=1)
    extra = torch.stack([mask.sum(1), (kl.detach() * mask).sum(1), (took_clip.float() * mask).sum(1),
                         (ent * mask).sum(1)])
    if cp_group is not None:                    # cp training: each rank scored its piece of every completion
        loss = sum_over_context(loss, cp_group)
        comm.all_reduce(extra, cp_group)
    return TokenTerms(loss, *extra, logged_entropy=tokens.entropy is not None)


def replica_share(terms: TokenTerms, prepared: GRPOBatch, config: GRPOConfig, size: int) -> torch.Tensor:
    """This replica's share of the global loss (sum_local x dp / the global count, per the normalisation)."""
    if config.normalization == "token":
        return terms.loss.sum() * size / prepared.tokens
    if config.normalization == "sequence":
        return (terms.loss / terms.counts.clamp(min=1)).sum() * size / prepared.sequences
    return terms.loss.sum() * size / (prepared.sequences * config.max_length)


def grpo_metrics(terms: TokenTerms, share: torch.Tensor, prepared: GRPOBatch, batch: GlobalBatch) -> dict[str, float]:
    """The logged global values, equal on every rank (one all-reduce)."""
    sums = batch.totals(share, terms.kl, terms.clipped, terms.entropy)
    tokens = prepared.tokens.clamp(min=1)
    return {"loss": (sums[0] / batch.size).item(), "reward/mean": prepared.reward_stats[0],
            "reward/std": prepared.reward_stats[1], "kl": (sums[1] / tokens).item(),
            "clip_fraction": (sums[2] / tokens).item(),
            "entropy": (sums[3] / tokens).item() if terms.logged_entropy else float("nan"),
            "response_length": (prepared.tokens / prepared.sequences).item()}
