"""The GRPO step on a boosted policy: what a training script calls once per rollout batch and once per
optimisation step.

Owns: `prepare_grpo` (once per rollout batch: the batch checked on every rank before any collective, the
advantages, the old policy's per-token log-probs, no gradient, and the reference's, the global counts) and
`grpo_step` / `grpo_loss` (one optimisation step's forward, and for grpo_step its backward, on a prepared batch:
call it several times per rollout batch, the old log-probs reused; with pipeline stages through
`execute_pipeline`, grpo_pipeline.py). The numbers are grpo_terms.py's. Must not run generation (rollout.py) nor
compute a log-prob itself (logprobs.py).
"""

from __future__ import annotations

import torch

from meshboost.plugins.hybrid_parallel import HybridParallelModule
from meshboost.post_training.batch import agree
from meshboost.post_training.grpo_pipeline import pipeline_grpo_step, pipeline_token_logprobs
from meshboost.post_training.grpo_terms import (GRPOBatch, GRPOBatchError, GRPOConfig, GRPOOutput, check_rollouts,
                                                group_advantages, grpo_metrics, replica_share, token_terms)
from meshboost.post_training.logprobs import TokenLogprobs, token_logprobs
from meshboost.post_training.objectives import GlobalBatch, dp_group_of
from meshboost.post_training.reference import adapters_disabled, check_reference
from meshboost.post_training.rollout import RolloutBatch


def _aligned(tokens: TokenLogprobs, positions) -> torch.Tensor:
    """A reference's per-token log-probs at the positions the policy scores (cp: eval scores whole sequences)."""
    if positions is not None and tokens.positions is None:
        return tokens.logprobs[:, positions]
    return tokens.logprobs


def prepare_grpo(model, rollout: RolloutBatch, rewards: torch.Tensor, config: GRPOConfig, reference=None,
                 booster=None, sequences_in_batch=None, tokens_in_batch=None) -> GRPOBatch:
    """Once per rollout batch: check it on every rank (whole groups of consecutive rows, one reward per row),
    the advantages, the old policy's log-probs (no gradient, in the model's mode: the one its steps run in),
    the reference's when config.beta > 0 (a model boosted like the policy, or BASE: LoRA's base weights) and the
    global counts. booster: needed with pipeline stages. sequences_in_batch / tokens_in_batch: the global
    completions and response tokens of a gradient-accumulation window this batch is one part of (default: this
    batch's, all-reduced); the loss and the per-token metrics are then this part's share of the window's (they add
    up over the window), the reward statistics this part's."""
    device = rollout.input_ids.device if isinstance(rollout, RolloutBatch) else None
    agree(check_rollouts(rollout, rewards), None, device, GRPOBatchError, "rollout batch")
    if config.beta > 0 and reference is None:
        raise ValueError(f"beta={config.beta} needs a reference: boost_reference(booster, model), or BASE (LoRA)")
    check_reference(model, reference if config.beta > 0 else None)
    group = dp_group_of(model)
    rewards = rewards.to(rollout.input_ids.device).float()
    advantages = group_advantages(rewards, rollout.group_size, config.scale_rewards, group)
    batch = GlobalBatch(group)
    n, s, s2, tokens = batch.totals(torch.tensor(float(rollout.rows), device=rewards.device), rewards,
                                    rewards * rewards, rollout.response_mask.sum().float())
    stats = ((s / n).item(), ((s2 - s * s / n) / (n - 1).clamp(min=1)).clamp(min=0).sqrt().item())
    n = n if sequences_in_batch is None else torch.as_tensor(float(sequences_in_batch), device=n.device)
    tokens = tokens if tokens_in_batch is None else torch.as_tensor(float(tokens_in_batch), device=n.device)
    if isinstance(model, HybridParallelModule) and model.pipeline is not None:
        old = pipeline_token_logprobs(booster, model, rollout)
        ref = None
        if config.beta > 0:
            with adapters_disabled(model) if isinstance(reference, str) else torch.no_grad():
                ref = pipeline_token_logprobs(booster, model if isinstance(reference, str) else reference, rollout)
        return GRPOBatch(rollout, rewards, advantages, old, ref, n, tokens, stats)
    with torch.no_grad():
        old = token_logprobs(model, rollout.model_batch())
    ref = None
    if config.beta > 0:
        with adapters_disabled(model) if isinstance(reference, str) else torch.no_grad():
            ref = _aligned(token_logprobs(model if isinstance(reference, str) else reference, rollout.model_batch()),
                           old.positions)
    return GRPOBatch(rollout, rewards, advantages, old.logprobs, ref, n, tokens, stats)


def grpo_loss(model, prepared: GRPOBatch, config: GRPOConfig) -> GRPOOutput:
    """The policy's forward on the prepared rollouts and this replica's share of the GRPO loss (not backwarded)."""
    tokens = token_logprobs(model, prepared.rollout.model_batch(), entropy=config.log_entropy)
    if tokens.logprobs.shape != prepared.old_logprobs.shape:
        raise RuntimeError(f"the policy scored {tuple(tokens.logprobs.shape)} positions, the prepared batch "
                           f"{tuple(prepared.old_logprobs.shape)}: prepare_grpo in the mode the steps run in")
    cp = model.context.group if isinstance(model, HybridParallelModule) and tokens.positions is not None else None
    terms = token_terms(tokens, prepared.old_logprobs, prepared.ref_logprobs, prepared.advantages, config, cp)
    batch = GlobalBatch(dp_group_of(model))
    share = replica_share(terms, prepared, config, batch.size)
    return GRPOOutput(share, grpo_metrics(terms, share, prepared, batch))


def grpo_step(booster, model, optimizer, prepared: GRPOBatch, config: GRPOConfig) -> GRPOOutput:
    """One optimisation step's forward and backward on `prepared` (the caller steps the optimizer); call it again
    on the same prepared batch for the next step on these rollouts. Returns the global metrics on every rank."""
    if isinstance(model, HybridParallelModule) and model.pipeline is not None:
        return pipeline_grpo_step(booster, model, optimizer, prepared, config)
    out = grpo_loss(model, prepared, config)
    booster.backward(out.loss, optimizer)
    return GRPOOutput(out.loss.detach(), out.metrics)
