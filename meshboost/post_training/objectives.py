"""The preference objectives over the global batch: the loss at any layout and any number of micro-batches
is the one process's loss of the same batch.

Owns: `GlobalBatch` (a mean over every data-parallel replica's examples: each replica returns
sum_local x dp / N_global, so the gradients' average over dp (x cp) is the gradient of the global mean, and
the replicas' values average to it; N is the global count, all-reduced, or the count of an accumulation
window the caller passes), `preference_loss` (DPO, IPO, SimPO, ORPO on a [chosen; rejected] batch's
`SequenceLogprobs`) and `kto_loss` (unpaired; its KL estimate over the global batch, not one replica's),
with the metrics a trainer logs (global means, equal at every layout). Must not run a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from meshboost.distributed import comm
from meshboost.booster.wrappers import ModelWrapper
from meshboost.post_training import losses as L
from meshboost.post_training.logprobs import SequenceLogprobs
from meshboost.plugins.hybrid_parallel import HybridParallelModule

PAIRED = ("dpo", "ipo", "simpo", "orpo")
NEEDS_REFERENCE = ("dpo", "ipo")


def dp_group_of(model):
    """The data-parallel group of a boosted model (None: one replica, or a model that was not boosted)."""
    if isinstance(model, HybridParallelModule):
        return model.mesh.dp_group if model.mesh.dp_size > 1 else None
    if isinstance(model, ModelWrapper) and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD               # DDP / LowLevelZero: every rank is a replica
    return None


class GlobalBatch:
    """Means over the global batch, from each replica's own rows (group: the data-parallel group)."""

    def __init__(self, group=None):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1

    def totals(self, *local: torch.Tensor) -> torch.Tensor:
        """Sums over every replica of the given local scalars (detached; one all-reduce)."""
        out = torch.stack([t.detach().float().sum() for t in local])
        if self.size > 1:
            comm.all_reduce(out, self.group)
        return out

    def mean(self, values: torch.Tensor, count=None) -> torch.Tensor:
        """This replica's share of the global mean of `values` (the count of all replicas' rows, or `count`)."""
        if count is None:
            count = self.totals(torch.tensor(float(values.numel()), device=values.device))[0]
        return values.sum() * self.size / count

    def metrics(self, named: dict[str, torch.Tensor]) -> dict[str, float]:
        """Global means of per-row values (all of one length), one all-reduce."""
        rows = next(iter(named.values()))
        sums = self.totals(*named.values(), torch.tensor(float(rows.numel()), device=rows.device))
        return {k: (sums[i] / sums[-1]).item() for i, k in enumerate(named)}


@dataclass(frozen=True)
class PreferenceOutput:
    loss: torch.Tensor                # this replica's share: backward it; the replicas' mean is `metrics["loss"]`
    metrics: dict[str, float]         # global means: loss, rewards/chosen, rewards/rejected, margins, accuracies, logps


def pair_terms(objective: str, chosen: SequenceLogprobs, rejected: SequenceLogprobs, ref, hyper: dict) -> L.PairTerms:
    """`objective`'s per-pair terms; ref: the reference's (chosen, rejected), or None."""
    if objective in NEEDS_REFERENCE and ref is None:
        raise ValueError(f"objective {objective!r} needs the reference model's log-probs (reference=...)")
    if objective == "dpo":
        return L.dpo(chosen.sums, rejected.sums, ref[0].sums, ref[1].sums, **hyper)
    if objective == "ipo":
        return L.ipo(chosen.sums, rejected.sums, ref[0].sums, ref[1].sums, chosen.counts, rejected.counts, **hyper)
    if objective == "simpo":
        return L.simpo(chosen.sums, rejected.sums, chosen.counts, rejected.counts, **hyper)
    if objective == "orpo":
        return L.orpo(chosen.sums, rejected.sums, chosen.counts, rejected.counts, **hyper)
    raise ValueError(f"objective={objective!r}: one of {PAIRED} (KTO is unpaired: kto_loss)")


def replica_share(objective: str, terms: L.PairTerms, chosen: SequenceLogprobs, pairs, chosen_tokens,
                  size: int) -> torch.Tensor:
    """This replica's share of the global loss from its own pairs: sum x dp / the global pair count (and, for
    ORPO, minus its chosen log-probs x dp / the global chosen tokens: the SFT term's token mean)."""
    loss = terms.losses.sum() * size / pairs
    if objective == "orpo":
        loss = loss - chosen.sums.sum() * size / chosen_tokens
    return loss


METRICS = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def metric_names(objective: str) -> tuple[str, ...]:
    """The keys `pair_metrics` returns for `objective`, in order."""
    return METRICS + (("nll",) if objective == "orpo" else ())


def pair_metrics(objective: str, terms: L.PairTerms, chosen: SequenceLogprobs, rejected: SequenceLogprobs,
                 batch: GlobalBatch, chosen_tokens=None) -> dict[str, float]:
    """The logged global means: loss, rewards/chosen, rewards/rejected, rewards/margins, rewards/accuracies,
    logps/chosen, logps/rejected (and ORPO's nll, in its loss)."""
    named = {"loss": terms.losses.detach(), "rewards/chosen": terms.chosen_rewards,
             "rewards/rejected": terms.rejected_rewards,
             "rewards/margins": terms.chosen_rewards - terms.rejected_rewards,
             "rewards/accuracies": (terms.chosen_rewards > terms.rejected_rewards).float(),
             "logps/chosen": chosen.sums.detach(), "logps/rejected": rejected.sums.detach()}
    metrics = batch.metrics(named)
    if objective == "orpo":                 # the SFT term: the chosen tokens' NLL, a token mean of the global batch
        sums = batch.totals(chosen.sums, chosen.counts)
        tokens = chosen_tokens if chosen_tokens is not None else sums[1]
        metrics["nll"] = (-sums[0] / tokens).item()
        metrics["loss"] += metrics["nll"]
    return metrics


def global_counts(chosen: SequenceLogprobs, batch: GlobalBatch, pairs_in_batch=None, chosen_tokens_in_batch=None):
    """(pairs, chosen tokens) of the global batch: the given counts of an accumulation window, else this
    call's, all-reduced over the replicas (one all-reduce)."""
    if pairs_in_batch is not None and chosen_tokens_in_batch is not None:
        return pairs_in_batch, chosen_tokens_in_batch
    totals = batch.totals(torch.tensor(float(chosen.sums.numel()), device=chosen.sums.device), chosen.counts)
    return (pairs_in_batch if pairs_in_batch is not None else totals[0],
            chosen_tokens_in_batch if chosen_tokens_in_batch is not None else totals[1])


def preference_loss(objective: str, policy: SequenceLogprobs, reference: SequenceLogprobs | None = None,
                    group=None, pairs_in_batch=None, chosen_tokens_in_batch=None, **hyper) -> PreferenceOutput:
    """`objective`'s loss of a [chosen; rejected] batch (`pair_batch`) over the global batch. group: the
    data-parallel group (`dp_group_of(model)`); pairs_in_batch / chosen_tokens_in_batch: the global counts of an
    accumulation window (default: this call's, all-reduced). hyper: the loss's beta, label_smoothing, gamma."""
    chosen, rejected = policy.halves()
    ref = reference.halves() if reference is not None else None
    terms = pair_terms(objective, chosen, rejected, ref, hyper)
    batch = GlobalBatch(group)
    pairs, tokens = global_counts(chosen, batch, pairs_in_batch, chosen_tokens_in_batch)
    loss = replica_share(objective, terms, chosen, pairs, tokens, batch.size)
    return PreferenceOutput(loss, pair_metrics(objective, terms, chosen, rejected, batch, tokens))


def kto_loss(policy: SequenceLogprobs, reference: SequenceLogprobs, desirable: torch.Tensor,
             kl_policy: SequenceLogprobs, kl_reference: SequenceLogprobs, group=None, examples_in_batch=None,
             **hyper) -> PreferenceOutput:
    """KTO over the global batch: `desirable` bool per row; the KL estimate is the mean of
    (policy - reference) log-probs of the mismatched completions (kl_*) over every replica's rows, detached."""
    batch = GlobalBatch(group)
    ratio = (kl_policy.sums - kl_reference.sums).detach()
    total = batch.totals(ratio, torch.tensor(float(ratio.numel()), device=ratio.device))
    kl = total[0] / total[1]
    losses, rewards = L.kto(policy.sums, reference.sums, desirable, kl, **hyper)
    loss = batch.mean(losses, examples_in_batch)
    return PreferenceOutput(loss, kto_metrics(losses, rewards, desirable, kl, batch))


KTO_METRICS = ("loss", "kl", "rewards/desirable", "rewards/undesirable")


def kto_metrics(losses: torch.Tensor, rewards: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor,
                batch: GlobalBatch) -> dict[str, float]:
    """KTO's logged global means (KTO_METRICS) from this replica's per-row losses and rewards (one all-reduce)."""
    good = desirable.bool().float()
    sums = batch.totals(losses, rewards * good, good, rewards * (1 - good), 1 - good)
    return {"loss": (sums[0] / (sums[2] + sums[4])).item(), "kl": max(kl.item(), 0.0),
            "rewards/desirable": (sums[1] / sums[2].clamp(min=1)).item(),
            "rewards/undesirable": (sums[3] / sums[4].clamp(min=1)).item()}
