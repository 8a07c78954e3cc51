"""One preference training step at any layout: the call a training script makes.

Owns: `preference_step` (the batch of pairs checked and laid out on every rank, the reference's log-probs,
the policy's loss over the global batch, its backward; through `execute_pipeline` when the model has
pipeline stages) and `BASE` (the reference is the policy's own base weights, LoRA). The caller steps the
optimizer. Must not compute a loss itself (objectives.py) nor run a schedule (pipeline.py).
"""

from __future__ import annotations

import torch

from meshboost.plugins.hybrid_parallel import HybridParallelModule
from meshboost.post_training.batch import pair_batch
from meshboost.post_training.logprobs import IGNORE_INDEX, sequence_logprobs
from meshboost.post_training.objectives import NEEDS_REFERENCE, GlobalBatch, PreferenceOutput, dp_group_of, preference_loss
from meshboost.post_training.pipeline import (pipeline_kto_step, pipeline_microbatches, pipeline_preference_step,
                                              refuse_unsupported)
from meshboost.post_training.reference import adapters_disabled, check_reference

BASE = "base"        # reference=BASE: the policy's base weights through peft's disable_adapter() (LoRA)


def _global_counts(batch: dict, microbatches: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, chosen tokens) of the global batch, from the labels, before any forward (one all-reduce)."""
    labels = batch["labels"].chunk(2 * microbatches)        # [chosen; rejected] per micro-batch
    chosen = torch.cat(labels[0::2])
    counts = torch.stack([torch.tensor(float(chosen.shape[0]), device=chosen.device),
                          (chosen[:, 1:] != IGNORE_INDEX).sum().float()])
    totals = GlobalBatch(group).totals(*counts)
    return totals[0], totals[1]


def preference_step(booster, model, optimizer, rows: dict, objective: str, reference=None, pad_token_id: int = 0,
                    max_length: int | None = None, pairs_in_batch=None, chosen_tokens_in_batch=None,
                    **hyper) -> PreferenceOutput:
    """Forward and backward of `objective` ("dpo", "ipo", "simpo", "orpo") on this replica's `rows` (chosen_* and
    rejected_* fields, `pair_batch`'s). reference: a frozen reference boosted like the policy (`boost_reference`),
    BASE (LoRA: the policy's base), or None (SimPO, ORPO). Returns the loss (backward already done: call
    optimizer.step()) and the global metrics, equal on every rank."""
    if objective in NEEDS_REFERENCE and reference is None:
        raise ValueError(f"objective {objective!r} needs a reference: boost_reference(booster, model) or BASE (LoRA)")
    check_reference(model, reference)
    pipelined = isinstance(model, HybridParallelModule) and model.pipeline is not None
    if pipelined:
        refuse_unsupported(model)
    group = dp_group_of(model)
    rows_here = next((v.shape[0] for k, v in rows.items() if k.startswith("chosen_") and torch.is_tensor(v)), 0) \
        if isinstance(rows, dict) else 0
    microbatches = pipeline_microbatches(model, 2 * rows_here) if pipelined else 1
    batch = pair_batch(rows, pad_token_id, max_length=max_length, microbatches=microbatches)
    if pipelined:
        pairs, tokens = _global_counts(batch, microbatches, group)
        return pipeline_preference_step(booster, model, optimizer, batch, objective, microbatches,
                                        reference=None if reference == BASE else reference, group=group,
                                        pairs=pairs_in_batch if pairs_in_batch is not None else pairs,
                                        chosen_tokens=chosen_tokens_in_batch if chosen_tokens_in_batch is not None
                                        else tokens, reference_base=reference == BASE, **hyper)
    ref = None
    if reference == BASE:
        with adapters_disabled(model):
            ref = sequence_logprobs(model, batch)
    elif reference is not None:
        with torch.no_grad():
            ref = sequence_logprobs(reference, batch)
    out = preference_loss(objective, sequence_logprobs(model, batch), ref, group=group, pairs_in_batch=pairs_in_batch,
                          chosen_tokens_in_batch=chosen_tokens_in_batch, **hyper)
    booster.backward(out.loss, optimizer)
    return out


def kto_step(booster, model, optimizer, batch: dict, kl_batch: dict, desirable: torch.Tensor, reference,
             examples_in_batch=None, **hyper) -> PreferenceOutput:
    """Forward and backward of KTO on this replica's unpaired `batch` (input_ids, attention_mask, labels), its
    `desirable` flags and `kl_batch` (the mismatched prompt/completion rows of its KL estimate). reference: a
    frozen reference boosted like the policy, or BASE (LoRA); through execute_pipeline at pp_size > 1."""
    from meshboost.post_training.objectives import kto_loss

    if reference is None:
        raise ValueError("KTO needs a reference: boost_reference(booster, model) or BASE (LoRA)")
    check_reference(model, reference)
    if isinstance(model, HybridParallelModule) and model.pipeline is not None:
        return pipeline_kto_step(booster, model, optimizer, batch, kl_batch, desirable,
                                 reference=None if reference == BASE else reference, reference_base=reference == BASE,
                                 group=dp_group_of(model), examples=examples_in_batch, **hyper)
    with adapters_disabled(model) if reference == BASE else torch.no_grad():
        ref_model = model if reference == BASE else reference
        ref, kl_ref = sequence_logprobs(ref_model, batch), sequence_logprobs(ref_model, kl_batch)
    with torch.no_grad():
        kl_policy = sequence_logprobs(model, kl_batch)
    out = kto_loss(sequence_logprobs(model, batch), ref, desirable, kl_policy, kl_ref, group=dp_group_of(model),
                   examples_in_batch=examples_in_batch, **hyper)
    booster.backward(out.loss, optimizer)
    return out
