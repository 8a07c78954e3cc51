"""Each label token's log-probability under a (boosted) causal LM, without the vocabulary ever whole.

Owns: running the model for log-probs (`token_logprobs`), the per-sequence sums over the labelled tokens
(`sequence_logprobs`), and the entropy of the next-token distribution on request. What it reads of a
boosted model is public: the HF model's `get_output_embeddings()` (a `VocabParallelLMHead` under tp, its
group and real vocabulary), `HybridParallelModule.context` (context parallelism: which positions this rank
holds) and `.mesh`. Must not reach into the sharder, copy a forward, or gather the vocabulary.

The numbers, as one process computes them (transformers' causal-LM loss, negated, per token):
- labels are shifted exactly as `ForCausalLMLoss` shifts them: position t holds log p(labels[t+1]), the
  last position none; a label of -100 (prompt, padding) does not count and holds 0.
- tp (vocab-parallel head): inside `split_logits()` every head returns its vocab shard, in eval too; the
  log-prob is minus the vocab-parallel cross-entropy per token (`reduction="none"`): the max and the
  softmax denominator all-reduced over tp, the label's logit taken on the rank that holds it. Padded
  vocabulary columns never count. Its backward is the cross-entropy's own.
- Megatron sequence parallelism: the head sees the whole sequence (sequence.py gathers it after the
  layer stack), so nothing changes here.
- context parallelism, training: the model returns this rank's piece of every sequence; the shifted
  labels are taken at the rank's positions (`ContextInputs.positions`), the per-sequence sums all-reduced
  over cp, with an all-reduce backward too: each rank's gradient reaches its own tokens, scaled by cp,
  which the dp x cp gradient average turns into the whole sequence's. In eval the model returns the whole
  sequences (context.py gathers them) and every cp rank reads them all.
- fp16/bf16 logits are read in fp32 (as transformers' loss upcasts them).
- loss_chunk_tokens (a chunked head): the head's input is scored chunk by chunk (`head_token_losses`), the
  logits never whole; the entropy, and cp's eval (whose logits context.py gathers), read whole logits.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshboost.distributed import comm
from meshboost.plugins.hybrid_parallel import HybridParallelModule
from meshboost.shardformer.layers.chunked_loss import chunked_hidden, head_token_losses, is_chunked
from meshboost.shardformer.layers.vocab import VocabParallelLMHead, split_logits, vocab_parallel_cross_entropy

IGNORE_INDEX = -100
# what a log-prob forward never passes on: the model would compute a loss we do not want
_NOT_MODEL_INPUTS = ("labels", "shift_labels", "num_items_in_batch")


@dataclass(frozen=True)
class TokenLogprobs:
    """Per-token log-probs of one forward, aligned with the model's output positions held here."""

    logprobs: torch.Tensor            # [B, S_here] log p(label of position t+1), 0 where it does not count
    mask: torch.Tensor                # [B, S_here] bool: the label counts (not -100, not past the end)
    positions: torch.Tensor | None    # the sequence positions held here (cp training); None: all of them
    entropy: torch.Tensor | None      # [B, S_here] next-token entropy (no gradient), when asked for


@dataclass(frozen=True)
class SequenceLogprobs:
    """Per-sequence sums over the labelled tokens of whole sequences (summed over cp), on every rank."""

    sums: torch.Tensor                # [B] sum of the labels' log-probs (differentiable)
    counts: torch.Tensor              # [B] labelled tokens (float, no gradient)
    entropy: torch.Tensor | None = None   # [B] sum of the labelled positions' entropies, when asked for

    def halves(self) -> tuple[SequenceLogprobs, SequenceLogprobs]:
        """(first half, second half) of the rows: (chosen, rejected) of a [chosen; rejected] batch."""
        n = self.sums.shape[0] // 2
        cut = [(t[:n], t[n:]) if t is not None else (None, None) for t in (self.sums, self.counts, self.entropy)]
        return SequenceLogprobs(*(c[0] for c in cut)), SequenceLogprobs(*(c[1] for c in cut))

    @property
    def means(self) -> torch.Tensor:
        """The length-normalised log-probs (SimPO, ORPO, IPO): sums over labelled tokens."""
        return self.sums / self.counts.clamp(min=1.0)


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a boosted model (or peft/DDP wrappers): the outermost PreTrainedModel."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"{type(model).__name__} holds no transformers PreTrainedModel: token_logprobs reads a causal LM")


def shifted_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM shift: position t is scored on labels[t+1], the last position on nothing."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def token_logprobs(model: torch.nn.Module, batch: dict, entropy: bool = False) -> TokenLogprobs:
    """Each label token's log-prob under `model` (boosted or not) for `batch` (input_ids, labels with -100 where
    a token does not count, attention_mask and the model's other inputs). Runs one forward, in the model's mode
    (train: differentiable; a frozen reference: call it in eval under torch.no_grad())."""
    labels = batch.get("labels")
    if not torch.is_tensor(labels) or labels.dim() != 2:
        raise ValueError("token_logprobs needs batch['labels'] [batch, sequence] (the input ids with -100 where a "
                         "token does not count: prompt, padding)")
    if isinstance(model, HybridParallelModule) and model.pipeline is not None:
        raise NotImplementedError("token_logprobs under pipeline stages (pp_size > 1) is not supported yet: the "
                                  "log-probs live on the last stage, inside execute_pipeline's criterion")
    inputs = {k: v for k, v in batch.items() if k not in _NOT_MODEL_INPUTS}
    inputs["use_cache"] = False
    head = hf_model(model).get_output_embeddings()
    context = model.context if isinstance(model, HybridParallelModule) else None
    # loss_chunk_tokens: the head's chunks score the labels (not for the entropy, nor cp's gathered eval logits)
    chunked = is_chunked(head) and not entropy and (context is None or model.training)
    with split_logits(), (chunked_hidden() if chunked else contextlib.nullcontext()) as taken:
        logits = model(**inputs).logits
        split = isinstance(head, VocabParallelLMHead) and head.output_is_parallel
    target = shifted_labels(labels.to(logits.device))
    positions = None
    if context is not None and model.training:          # this rank's piece of every sequence
        positions = context.positions(labels.shape[1], logits.device)
        target = target[:, positions]
    if chunked:
        losses = head_token_losses(*taken[-1], target, ignore_index=IGNORE_INDEX)
        return TokenLogprobs(-losses, target != IGNORE_INDEX, positions, None)
    return label_logprobs(logits, target, head, split, entropy, positions)


def label_logprobs(logits: torch.Tensor, target: torch.Tensor, head, split: bool, entropy: bool = False,
                   positions: torch.Tensor | None = None) -> TokenLogprobs:
    """The log-prob of each (already shifted) `target` under `logits` [B, S, V or V/tp]: minus the vocab-parallel
    cross-entropy when `split` (the logits are `head`'s vocab shard), else the ordinary one; -100 counts 0."""
    if logits.shape[:2] != target.shape:
        raise ValueError(f"the model returned logits {tuple(logits.shape)} for labels {tuple(target.shape)}")
    if split:
        losses = vocab_parallel_cross_entropy(logits, target, head.process_group, head.vocab_size,
                                              ignore_index=IGNORE_INDEX, reduction="none")
    else:
        flat = logits.reshape(-1, logits.shape[-1]).float()
        losses = F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX,
                                 reduction="none").view(target.shape)
    mask = target != IGNORE_INDEX
    ent = None
    if entropy:
        ent = _entropy(logits, head, split).masked_fill(~mask, 0.0)
    return TokenLogprobs(-losses, mask, positions, ent)


@torch.no_grad()
def _entropy(logits: torch.Tensor, head, split: bool) -> torch.Tensor:
    """H = log Z - sum_j p_j s_j with s = logits - max: over the vocab shards, three per-token sums reduced
    over tp (the max, Z, sum exp(s) s); padded vocabulary columns hold no probability."""
    x = logits.float()
    group = head.process_group if split else None
    if split:
        part = x.shape[-1]
        start = dist.get_rank(group) * part
        if start + part > head.vocab_size:
            col = torch.arange(start, start + part, device=x.device)
            x = x.masked_fill(col >= head.vocab_size, float("-inf"))
    top = x.amax(dim=-1)
    if split:
        comm.all_reduce(top, group, op=dist.ReduceOp.MAX)
    s = x - top.unsqueeze(-1)
    e = s.exp()
    sums = torch.stack([e.sum(-1), torch.where(e > 0, e * s, torch.zeros_like(s)).sum(-1)])
    if split:
        comm.all_reduce(sums, group)
    return sums[0].log() - sums[1] / sums[0]


def sum_over_context(values: torch.Tensor, group) -> torch.Tensor:
    """Per-sequence sums of every cp rank's piece: all-reduced forward, and backward (the exact adjoint,
    `copy_to_tp` after `reduce_from_tp`: any group, whatever their names say)."""
    return comm.copy_to_tp(comm.reduce_from_tp(values, group), group)


def sequence_logprobs(model: torch.nn.Module, batch: dict, entropy: bool = False) -> SequenceLogprobs:
    """Per-sequence sums of `token_logprobs` over the labelled tokens of the whole sequences, and their counts,
    equal on every rank of a replica (tp, cp) to one process's."""
    tokens = token_logprobs(model, batch, entropy)
    sums = (tokens.logprobs * tokens.mask).sum(dim=1)
    counts = tokens.mask.sum(dim=1).float()
    ent = tokens.entropy.sum(dim=1) if tokens.entropy is not None else None
    if tokens.positions is not None:                    # cp training: each rank scored its piece
        group = model.context.group
        sums = sum_over_context(sums, group)
        extra = torch.stack([counts] + ([ent] if ent is not None else []))
        comm.all_reduce(extra, group)
        counts, ent = extra[0], (extra[1] if ent is not None else None)
    return SequenceLogprobs(sums, counts, ent)
