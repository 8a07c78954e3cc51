"""Label log-probs and the paired preference losses under pipeline parallelism, through `execute_pipeline`.

Owns: `PairScorer` (the criterion the last stage calls on each micro-batch's output: it scores the
micro-batch's label log-probs from its logits, vocab-parallel under tp, and, training, returns that
micro-batch's part of the global loss), `pipeline_sequence_logprobs` (a forward-only step: the per-sequence
sums of a whole batch, on the last stage), `pipeline_preference_step` (the reference's forward-only
step, then the policy's training step; the metrics on every rank) and `pipeline_kto_step` (KTO: the
forward-only passes of its KL rows and the reference, the KL estimate over the last stage's dp group, then
the policy's training step). Must not reach into the schedule: it
uses `execute_pipeline` and the schedule's public `num_microbatches` / `microbatch_size` / `comm`.

The numbers, as one process computes them:
- a step's rows come laid out by `pair_batch(..., microbatches=M)`: each of the schedule's M equal
  micro-batches holds [chosen; rejected] of whole pairs, so each micro-batch's loss needs nothing of another;
- the labels never reach the model: the batch given to the pipeline holds only the model's inputs (no
  `labels`: the model computes no loss of its own, and the schedule weighs every micro-batch 1/M, the
  mean of micro-batch losses, normalization.py), and the scorer holds the shifted labels, checking at each
  call that the micro-batch it is handed is the one it scores (its input ids);
- micro-batch m returns M x (its pairs' losses summed) x dp / the global pair count (ORPO: minus its chosen
  log-probs x M x dp / the global chosen tokens), so the schedule's 1/M and the gradient average over dp
  give the gradient of the one-process mean over the whole global batch.
- KTO's rows are unpaired: any equal split into micro-batches keeps each row whole, and micro-batch m returns
  M x (its rows' losses summed) x dp / the global row count; its KL estimate (a detached constant of the step)
  is known on the last stage before the training pass starts.
Under cp the last stage holds a piece of every sequence (`context.check_criterion`): refused.
"""

from __future__ import annotations

import contextlib

import torch

from meshboost.post_training import losses as L
from meshboost.post_training.batch import agree
from meshboost.post_training.logprobs import SequenceLogprobs, hf_model, label_logprobs, shifted_labels
from meshboost.post_training.objectives import (KTO_METRICS, GlobalBatch, PreferenceOutput, kto_metrics,
                                                metric_names, pair_metrics, pair_terms, replica_share)
from meshboost.shardformer.layers.vocab import VocabParallelLMHead, split_logits


class PairScorer:
    """execute_pipeline's criterion(outputs, inputs) on the last stage: scores micro-batch after micro-batch
    (in the schedule's order, checked) from its logits. `loss_of(m, scored)`: micro-batch m's loss (training);
    None: a forward-only step (the returned scalar is the sum of log-probs, unused)."""

    def __init__(self, model, batch: dict, microbatches: int, loss_of=None):
        self.model, self.loss_of = model, loss_of
        self.ids = batch["input_ids"].chunk(microbatches)
        self.targets = shifted_labels(batch["labels"]).chunk(microbatches)
        self.scored: list[SequenceLogprobs] = []

    def __call__(self, outputs, inputs: dict) -> torch.Tensor:
        m = len(self.scored)
        ids = inputs.get("input_ids")
        if m >= len(self.ids) or not torch.is_tensor(ids) or not torch.equal(ids, self.ids[m].to(ids.device)):
            raise RuntimeError(f"the pipeline's last stage handed micro-batch {m} other input ids than the pairs "
                               "scored there: call pipeline_preference_step with the batch the step runs")
        head = hf_model(self.model).get_output_embeddings()
        split = isinstance(head, VocabParallelLMHead) and head.output_is_parallel
        target = self.targets[m].to(outputs.logits.device)
        tokens = label_logprobs(outputs.logits, target, head, split)
        scored = SequenceLogprobs((tokens.logprobs * tokens.mask).sum(dim=1), tokens.mask.sum(dim=1).float())
        self.scored.append(scored)
        if self.loss_of is None:
            return scored.sums.detach().sum()
        return self.loss_of(m, scored)


def _model_inputs(batch: dict) -> dict:
    """What the pipeline hands the model: its inputs, no labels (the scorer holds them)."""
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"], "use_cache": False}


def pipeline_microbatches(model, rows: int) -> int:
    """The micro-batches execute_pipeline splits a step of `rows` rows (two per pair) into."""
    schedule = model.pipeline
    if schedule.num_microbatches is not None:
        return schedule.num_microbatches
    return max(rows // schedule.microbatch_size, 1)


def refuse_unsupported(model) -> None:
    """Raised alike on every rank (it reads the layout only), before any collective."""
    if model.mesh.cp_size > 1:
        raise NotImplementedError(
            f"preference objectives with pp_size={model.mesh.pp_size} x cp_size={model.mesh.cp_size}: the last stage "
            "holds a piece of every sequence there, whose log-probs execute_pipeline's criterion cannot sum; use "
            "pp_size=1 with cp, or cp_size=1 with pp")


def pipeline_sequence_logprobs(booster, model, batch: dict, microbatches: int) -> list[SequenceLogprobs] | None:
    """A forward-only step of `model` (boosted with pp; a frozen reference, or the policy under
    `adapters_disabled`) on a `pair_batch(..., microbatches=M)` batch: the per-sequence sums of each micro-batch
    on the last stage, None on the other stages."""
    refuse_unsupported(model)
    scorer = PairScorer(model, batch, microbatches)
    with split_logits(), torch.no_grad():
        booster.execute_pipeline(iter([_model_inputs(batch)]), model, scorer, None, return_loss=True)
    return scorer.scored if model.mesh.pp_rank == model.mesh.pp_size - 1 else None


def pipeline_preference_step(booster, model, optimizer, batch: dict, objective: str, microbatches: int,
                             reference=None, group=None, pairs=None, chosen_tokens=None,
                             reference_base: bool = False, **hyper) -> PreferenceOutput:
    """One training step (forward and backward; the caller steps the optimizer) of `objective` on a
    `pair_batch(..., microbatches=M)` batch at pp_size > 1. reference: the frozen reference boosted like the
    policy (`boost_reference`), or reference_base: the policy's base weights (LoRA, `adapters_disabled`).
    pairs / chosen_tokens: the global counts (of an accumulation window), agreed by the caller. Returns the
    global loss (detached: already backwarded) and the metrics, on every rank."""
    from meshboost.post_training.reference import adapters_disabled

    refuse_unsupported(model)
    ref = None
    if reference is not None or reference_base:
        with adapters_disabled(model) if reference_base else contextlib.nullcontext():
            ref = pipeline_sequence_logprobs(booster, model if reference_base else reference, batch, microbatches)
    size = GlobalBatch(group).size
    kept = []

    def loss_of(m: int, scored: SequenceLogprobs) -> torch.Tensor:
        chosen, rejected = scored.halves()
        terms = pair_terms(objective, chosen, rejected, ref[m].halves() if ref is not None else None, hyper)
        kept.append((terms, chosen, rejected))
        return replica_share(objective, terms, chosen, pairs, chosen_tokens, size) * microbatches

    with split_logits():
        booster.execute_pipeline(iter([_model_inputs(batch)]), model, PairScorer(model, batch, microbatches, loss_of),
                                 optimizer, return_loss=True)
    names = metric_names(objective)
    values = torch.zeros(len(names), dtype=torch.float64, device=model.mesh.device)
    if kept:                                    # the last stage: global means over its dp group
        terms, chosen, rejected = (_cat([k[i] for k in kept]) for i in range(3))
        metrics = pair_metrics(objective, terms, chosen, rejected, GlobalBatch(group), chosen_tokens)
        values = torch.tensor([metrics[n] for n in names], dtype=torch.float64, device=values.device)
    values = model.pipeline.comm.broadcast_from_last(values).tolist()
    metrics = dict(zip(names, values))
    return PreferenceOutput(torch.tensor(metrics["loss"]), metrics)


def _even_microbatches(model, rows: int, what: str, group) -> int:
    """The micro-batches of a KTO pass of `rows` rows, refused on every rank of `group` when they do not split
    evenly (the scorer's micro-batch m must be the schedule's)."""
    m = pipeline_microbatches(model, rows)
    schedule = model.pipeline
    size = schedule.microbatch_size if schedule.num_microbatches is None else rows // m
    agree(None if rows % m == 0 and rows >= m and m * size == rows else
          f"KTO under pipeline stages: the {rows} {what} rows of this replica do not split into {m} equal "
          "micro-batches; give each replica a multiple of the micro-batches' rows", group, model.mesh.device)
    return m


def pipeline_kto_step(booster, model, optimizer, batch: dict, kl_batch: dict, desirable: torch.Tensor,
                      reference=None, reference_base: bool = False, group=None, examples=None,
                      **hyper) -> PreferenceOutput:
    """One KTO training step (forward and backward; the caller steps the optimizer) at pp_size > 1 on this
    replica's unpaired `batch` (input_ids, attention_mask, labels), its `desirable` flags and `kl_batch` (the
    mismatched rows of the KL estimate). reference: the frozen reference boosted like the policy, or
    reference_base (LoRA). examples: the global row count (default: agreed here). Returns the global loss
    (detached) and the metrics, on every rank."""
    from meshboost.post_training.reference import adapters_disabled

    refuse_unsupported(model)
    world = None                                 # the refusals reach every rank: all stages run every pass
    m, m_kl = (_even_microbatches(model, b["input_ids"].shape[0], what, world)
               for b, what in ((batch, "training"), (kl_batch, "KL")))
    last = model.mesh.pp_rank == model.mesh.pp_size - 1
    with adapters_disabled(model) if reference_base else contextlib.nullcontext():
        ref_model = model if reference_base else reference
        ref = pipeline_sequence_logprobs(booster, ref_model, batch, m)
        kl_ref = pipeline_sequence_logprobs(booster, ref_model, kl_batch, m_kl)
    kl_policy = pipeline_sequence_logprobs(booster, model, kl_batch, m_kl)
    dp = GlobalBatch(group)
    if examples is None:
        examples = dp.totals(torch.tensor(float(batch["input_ids"].shape[0]), device=model.mesh.device))[0]
    kl = torch.zeros((), device=model.mesh.device)
    if last:                                     # the global batch's estimate, over the last stage's dp group
        ratio = (_cat(kl_policy).sums - _cat(kl_ref).sums).detach()
        total = dp.totals(ratio, torch.tensor(float(ratio.numel()), device=ratio.device))
        kl = total[0] / total[1]
    flags = desirable.bool().chunk(m)
    kept = []

    def loss_of(i: int, scored: SequenceLogprobs) -> torch.Tensor:
        losses, rewards = L.kto(scored.sums, ref[i].sums, flags[i].to(scored.sums.device), kl, **hyper)
        kept.append((losses, rewards))
        return losses.sum() * dp.size / examples * m

    with split_logits():
        booster.execute_pipeline(iter([_model_inputs(batch)]), model, PairScorer(model, batch, m, loss_of),
                                 optimizer, return_loss=True)
    values = torch.zeros(len(KTO_METRICS), dtype=torch.float64, device=model.mesh.device)
    if kept:
        losses, rewards = (torch.cat([k[j] for k in kept]) for j in range(2))
        metrics = kto_metrics(losses, rewards, desirable.to(losses.device), kl, dp)
        values = torch.tensor([metrics[n] for n in KTO_METRICS], dtype=torch.float64, device=values.device)
    metrics = dict(zip(KTO_METRICS, model.pipeline.comm.broadcast_from_last(values).tolist()))
    return PreferenceOutput(torch.tensor(metrics["loss"]), metrics)


def _cat(parts: list):
    """Micro-batches' terms (or log-prob sums) concatenated back into the replica's rows."""
    first = parts[0]
    fields = [f for f in first.__dataclass_fields__]
    joined = {f: (torch.cat([getattr(p, f) for p in parts]) if getattr(first, f) is not None else None) for f in fields}
    return type(first)(**joined)
