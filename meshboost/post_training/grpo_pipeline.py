"""The GRPO step under pipeline parallelism, through `execute_pipeline`.

Owns: `TokenScorer` (the criterion the last stage calls on each micro-batch: its per-token label log-probs from
the (vocab-split) logits, checked to be the micro-batch it expects), `pipeline_token_logprobs` (a forward-only
step: the per-token log-probs of a whole rollout batch on the last stage, the old policy's or the reference's)
and `pipeline_grpo_step` (the training step: micro-batch m returns M x its share of the global loss, so the
schedule's 1/M per micro-batch and the gradient average over dp give the one-process gradient; the metrics
travel from the last stage to every rank). Must not reach into the schedule.

A completion's terms need nothing of another completion once the advantages are known (`prepare_grpo` computes
them from the replica's whole groups before any micro-batch runs), so the schedule's equal split of the rows
may cut a group: the loss is the same. Rows that do not split into the schedule's equal micro-batches are
refused on every rank.
"""

from __future__ import annotations

import torch

from meshboost.post_training.batch import agree
from meshboost.post_training.grpo_terms import (METRICS, GRPOBatchError, GRPOOutput, TokenTerms, grpo_metrics,
                                                replica_share, token_terms)
from meshboost.post_training.logprobs import hf_model, label_logprobs, shifted_labels
from meshboost.post_training.objectives import GlobalBatch, dp_group_of
from meshboost.post_training.pipeline import _model_inputs, pipeline_microbatches, refuse_unsupported
from meshboost.shardformer.layers.vocab import VocabParallelLMHead, split_logits


class TokenScorer:
    """execute_pipeline's criterion on the last stage: scores micro-batch after micro-batch (checked) from its
    logits; `loss_of(m, tokens)`: micro-batch m's loss (training), None: a forward-only step."""

    def __init__(self, model, batch: dict, microbatches: int, loss_of=None, entropy: bool = False):
        self.model, self.loss_of, self.entropy = model, loss_of, entropy
        self.ids = batch["input_ids"].chunk(microbatches)
        self.targets = shifted_labels(batch["labels"]).chunk(microbatches)
        self.scored = []

    def __call__(self, outputs, inputs: dict) -> torch.Tensor:
        m = len(self.scored)
        ids = inputs.get("input_ids")
        if m >= len(self.ids) or not torch.is_tensor(ids) or not torch.equal(ids, self.ids[m].to(ids.device)):
            raise RuntimeError(f"the pipeline's last stage handed micro-batch {m} other input ids than the rollouts "
                               "scored there: call grpo_step with the batch prepare_grpo prepared")
        head = hf_model(self.model).get_output_embeddings()
        split = isinstance(head, VocabParallelLMHead) and head.output_is_parallel
        tokens = label_logprobs(outputs.logits, self.targets[m].to(outputs.logits.device), head, split, self.entropy)
        self.scored.append(tokens)
        if self.loss_of is None:
            return tokens.logprobs.detach().sum()
        return self.loss_of(m, tokens)


def _microbatches(model, rows: int) -> int:
    m = pipeline_microbatches(model, rows)
    schedule = model.pipeline
    size = schedule.microbatch_size if schedule.num_microbatches is None else rows // m
    agree(None if rows % m == 0 and rows >= m and m * size == rows else
          f"GRPO under pipeline stages: the {rows} rollout rows of this replica do not split into {m} equal "
          "micro-batches; give each replica a multiple of the micro-batch rows", None, model.mesh.device,
          GRPOBatchError, "rollout batch")
    return m


def pipeline_token_logprobs(booster, model, rollout) -> torch.Tensor | None:
    """A forward-only step of `model` (the policy, a reference boosted like it, or the policy under
    `adapters_disabled`) on `rollout`: the per-token log-probs [N, S] on the last stage, None elsewhere."""
    refuse_unsupported(model)
    batch = rollout.model_batch()
    scorer = TokenScorer(model, batch, _microbatches(model, rollout.rows))
    with split_logits(), torch.no_grad():
        booster.execute_pipeline(iter([_model_inputs(batch)]), model, scorer, None, return_loss=True)
    if model.mesh.pp_rank != model.mesh.pp_size - 1:
        return None
    return torch.cat([t.logprobs for t in scorer.scored])


def pipeline_grpo_step(booster, model, optimizer, prepared, config):
    """One GRPO training step (forward and backward; the caller steps the optimizer) at pp_size > 1."""
    refuse_unsupported(model)
    batch = prepared.rollout.model_batch()
    m = _microbatches(model, prepared.rollout.rows)
    size = GlobalBatch(dp_group_of(model)).size
    last = model.mesh.pp_rank == model.mesh.pp_size - 1
    chunks = [x.chunk(m) if x is not None else [None] * m
              for x in ((prepared.old_logprobs, prepared.ref_logprobs, prepared.advantages) if last else ())]
    kept = []

    def loss_of(i: int, tokens):
        terms = token_terms(tokens, chunks[0][i], chunks[1][i], chunks[2][i], config)
        share = replica_share(terms, prepared, config, size)
        kept.append((terms, share.detach()))
        return share * m

    with split_logits():
        booster.execute_pipeline(iter([_model_inputs(batch)]), model,
                                 TokenScorer(model, batch, m, loss_of, entropy=config.log_entropy), optimizer, return_loss=True)
    values = torch.zeros(len(METRICS), dtype=torch.float64, device=model.mesh.device)
    if kept:
        fields = [f for f in TokenTerms.__dataclass_fields__ if f != "logged_entropy"]
        terms = TokenTerms(*(torch.cat([getattr(k[0], f) for k in kept]) for f in fields),
                           logged_entropy=config.log_entropy)
        share = torch.stack([k[1] for k in kept]).sum()
        metrics = grpo_metrics(terms, share, prepared, GlobalBatch(dp_group_of(model)))
        values = torch.tensor([metrics[n] for n in METRICS], dtype=torch.float64, device=values.device)
    metrics = dict(zip(METRICS, model.pipeline.comm.broadcast_from_last(values).tolist()))
    return GRPOOutput(torch.tensor(metrics["loss"]), metrics)
