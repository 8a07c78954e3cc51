"""The causal-LM loss with the logits never whole: the LM head and the cross-entropy run over chunks of tokens.

Owns: `chunked_linear_cross_entropy` (per-token losses of `hidden @ weight.T` against target ids, one chunk of
`chunk_tokens` rows at a time: each chunk's logits are freed after its loss and recomputed in the backward,
the head's weight gradient accumulated chunk by chunk), the heads that hand their input to that loss instead
of computing logits (`ChunkedLinearHead` at tp=1, `ChunkedVocabParallelLMHead` under tp), and
`install_chunked_loss`, which swaps the model's LM head and `loss_function` (ShardConfig(loss_chunk_tokens=N)),
and `chunked_hidden` / `head_token_losses`, through which post_training's log-probs score labels the same way.
Must not fork a transformers forward, gather the vocabulary, or communicate outside the tp group.

The numbers (each row of the loss is the row of today's loss; see docs/optimizations.md):
- tp=1: one chunk's logits [chunk, V] in fp32 (the head's output upcast, as transformers' loss does); the
  row's max, softmax denominator and target logit give `log(sum exp(l - max)) - (l_target - max)`.
- tp (vocab-parallel head, weight rows split): each rank's chunk holds its vocabulary shard, padded columns
  masked; after every chunk, the rows' local max and local sum; then the max all-reduced (MAX) and one
  all-reduce of [target logit - max, local sum rescaled to the global max] (SUM): the unchunked loss's two
  collectives, 3 x tokens fp32 per call whatever the chunk, never one of the vocabulary. The input gradient is partial over the shards: the head's
  `copy_to_tp` before the loss all-reduces it, as the unchunked head does.
- backward: softmax = exp(l - max) / sum, minus one at the target, times the row's incoming gradient
  (ignored rows none, as torch's nll_loss): the same entries as the unchunked loss's; the weight gradient
  sums the chunks' products in fp32 (a different summation order: equal to rounding, not bitwise).
- sequence parallelism: the head sees the whole sequence (sequence.py gathers it), context parallelism a
  rank's piece with its shifted labels, a pipeline's last stage its micro-batch: the loss function's
  reduction (sum / num_items_in_batch, else the mean over labelled tokens) is the one it replaces.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from meshboost.distributed import comm
from meshboost.shardformer.layers.vocab import (VocabParallelLMHead, check_in_range, reduce_token_losses,
                                                uses_causal_lm_loss)


def check_chunk_tokens(value) -> None:
    """loss_chunk_tokens must be None (off) or a positive int (pure: the same error on every rank)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"loss_chunk_tokens={value!r} must be a positive number of tokens per chunk (e.g. 1024), "
                         "or None to compute the LM head's logits whole")


def _chunk_logits(x, weight, bias, start: int, vocab_size: int) -> torch.Tensor:
    """One chunk's logits in fp32, the padded vocabulary columns of this shard never winning."""
    logits = F.linear(x, weight, bias).float()
    part = logits.shape[-1]
    if start + part > vocab_size:
        col = torch.arange(start, start + part, device=logits.device)
        logits.masked_fill_(col >= vocab_size, torch.finfo(logits.dtype).min)
    return logits


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, target, group, vocab_size, ignore_index, chunk):
        # x [N, H] (working dtype), weight [V_local, H], target [N] global ids; group None: no tp.
        rank = dist.get_rank(group) if group is not None else 0
        start, n = rank * weight.shape[0], x.shape[0]
        ignored = target == ignore_index
        check_in_range(target, ~ignored & ((target < 0) | (target >= vocab_size)),
                       f"labels must be {ignore_index} (ignored) or lie in [0, {vocab_size}) (the vocabulary)")
        owned = (target >= start) & (target < start + weight.shape[0]) & ~ignored
        local_t = (target - start).masked_fill(~owned, 0)
        row_max = torch.empty(n, dtype=torch.float32, device=x.device)
        local_sum, picked = torch.empty_like(row_max), torch.empty_like(row_max)
        for s in range(0, n, chunk):
            logits = _chunk_logits(x[s:s + chunk], weight, bias, start, vocab_size)
            row_max[s:s + chunk] = top = logits.amax(dim=-1)
            picked[s:s + chunk] = logits.gather(-1, local_t[s:s + chunk, None]).squeeze(-1)
            local_sum[s:s + chunk] = logits.sub_(top[:, None]).exp_().sum(dim=-1)
            del logits                              # the chunk's logits go before the next chunk's come
        if group is None:
            global_max = row_max
        else:                                       # the max over tp, then both sums in one all-reduce
            global_max = comm.all_reduce(row_max.clone(), group, op=dist.ReduceOp.MAX)
        shifted_target = (picked - global_max).masked_fill(~owned, 0.0)
        if group is None:
            sum_exp = local_sum
        else:
            sums = torch.stack([shifted_target, local_sum * (row_max - global_max).exp()])
            comm.all_reduce(sums, group)
            shifted_target, sum_exp = sums[0], sums[1]
        loss = (sum_exp.log() - shifted_target).masked_fill(ignored, 0.0)
        ctx.save_for_backward(x, weight, bias, global_max, sum_exp, owned, local_t, ignored)
        ctx.start, ctx.vocab_size, ctx.chunk = start, vocab_size, chunk
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        x, weight, bias, global_max, sum_exp, owned, local_t, ignored = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        scale = grad_loss.masked_fill(ignored, 0.0)       # ignored rows: no gradient whatever flows in
        grad_x = torch.empty_like(x) if need_x else None
        # summed over the chunks in fp32, rounded to the weight's dtype once
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        chunk = ctx.chunk
        for s in range(0, x.shape[0], chunk):
            rows = slice(s, s + chunk)
            x_c = x[rows]
            grad = _chunk_logits(x_c, weight, bias, ctx.start, ctx.vocab_size)
            grad.sub_(global_max[rows, None]).exp_().div_(sum_exp[rows, None]).mul_(scale[rows, None])
            index = torch.arange(grad.shape[0], device=grad.device)
            grad[index, local_t[rows]] -= owned[rows].to(grad.dtype) * scale[rows]
            grad = grad.to(x.dtype)                       # as the unchunked head's backward receives it
            if need_x:
                grad_x[rows] = grad @ weight
            if need_w:
                grad_w.addmm_(grad.t().float(), x_c.float())
            if need_b:
                grad_b += grad.float().sum(dim=0)
            del grad
        grad_w = grad_w.to(weight.dtype) if need_w else None
        grad_b = grad_b.to(bias.dtype) if need_b else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


def chunked_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                 target: torch.Tensor, chunk_tokens: int, group=None, vocab_size: int | None = None,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy [...] of the logits `hidden [..., H] @ weight.T (+ bias)` against `target [...]`,
    `chunk_tokens` rows at a time, never holding more than one chunk's logits. `group`: the tp group `weight`'s
    rows (the vocabulary) are split over (None: the whole vocabulary here); `vocab_size`: the real vocabulary
    (rows past it are padding). Ignored targets give 0."""
    check_chunk_tokens(chunk_tokens)
    if group is not None and not comm.is_parallel(group):
        group = None
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    flat = hidden.reshape(-1, hidden.shape[-1])
    flat_target = target.reshape(-1).to(flat.device)
    if flat.shape[0] != flat_target.shape[0]:
        raise ValueError(f"the LM head's input holds {flat.shape[0]} tokens ({tuple(hidden.shape)}) for "
                         f"{flat_target.shape[0]} labels ({tuple(target.shape)}): pass logits_to_keep=0 with labels")
    losses = _ChunkedLinearCrossEntropy.apply(flat, weight, bias, flat_target, group, vocab_size, ignore_index,
                                              chunk_tokens)
    return losses.view(target.shape)


class _Pending:
    """What a chunked head handed the loss in the current forward: its input and the stand-in it returned."""

    def __init__(self):
        self.armed = contextvars.ContextVar("meshboost_chunked_loss_armed", default=False)
        self.stand_in: torch.Tensor | None = None
        self.hidden: torch.Tensor | None = None


# Set inside `chunked_hidden()`: the list every chunked head appends (head, its input) to, in any mode.
_TAKE = contextvars.ContextVar("meshboost_chunked_hidden", default=None)


@contextlib.contextmanager
def chunked_hidden():
    """Inside the block every chunked LM head returns the empty stand-in for its logits, in any mode and without
    labels, and appends (head, its input) to the list yielded, for a reader that scores labels itself through
    `head_token_losses` (post_training's log-probs). Scoped to the caller's context, nothing stored on a module."""
    taken: list = []
    token = _TAKE.set(taken)
    try:
        yield taken
    finally:
        _TAKE.reset(token)


class _ChunkedHeadMixin:
    """Inside a training forward given labels, the head returns an empty stand-in `[..., 0]` for its logits
    and keeps its input for the chunked loss; otherwise it computes its logits as the head it replaces."""

    pending: _Pending
    chunk_tokens: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        taken = _TAKE.get()
        if taken is not None:
            taken.append((self, x))
            return x.new_empty((*x.shape[:-1], 0))
        if not (self.training and self.pending.armed.get()):
            return super().forward(x)
        self.pending.hidden = x
        self.pending.stand_in = x.new_empty((*x.shape[:-1], 0))     # no logits: any reader of them fails
        return self.pending.stand_in


def is_chunked(head) -> bool:
    """True for an LM head that `install_chunked_loss` put in place."""
    return isinstance(head, _ChunkedHeadMixin)


def head_token_losses(head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, vocab_size: int | None = None,
                      ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy [...] of a chunked head's logits for its input `hidden` against `target` (already
    shifted), its `chunk_tokens` at a time; under tp the vocab-split chunks, the input gradient summed over tp."""
    group = None
    if isinstance(head, VocabParallelLMHead):
        group = head.process_group
        hidden = comm.copy_to_tp(hidden, group)           # the input gradient, partial per shard, summed over tp
        vocab_size = head.vocab_size if vocab_size is None else vocab_size
    return chunked_linear_cross_entropy(hidden, head.weight, head.bias, target.to(hidden.device), head.chunk_tokens,
                                        group, vocab_size, ignore_index)


class ChunkedLinearHead(_ChunkedHeadMixin, nn.Linear):
    """An nn.Linear LM head (tp=1, or a replicated vocabulary) whose training logits are the chunked loss's."""

    @classmethod
    def from_native(cls, module: nn.Linear, pending: _Pending, chunk_tokens: int):
        new = cls(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        new.weight, new.bias = module.weight, module.bias           # the same parameters
        new.pending, new.chunk_tokens = pending, chunk_tokens
        new.train(module.training)
        return new


class ChunkedVocabParallelLMHead(_ChunkedHeadMixin, VocabParallelLMHead):
    """A vocab-parallel LM head whose training logits are the chunked loss's (vocab-split chunks)."""

    @classmethod
    def from_parallel(cls, module: VocabParallelLMHead, pending: _Pending, chunk_tokens: int):
        new = cls(module.weight, module.bias, module.process_group, module.vocab_size, module.parallel_output)
        new.pending, new.chunk_tokens = pending, chunk_tokens
        new.train(module.training)
        return new


def _labels_given(position: int | None, args, kwargs) -> bool:
    """Whether a forward call passes labels (by keyword, or at their place among the positional inputs):
    transformers' forward then computes its loss from the head's logits."""
    if kwargs.get("labels") is not None:
        return True
    return position is not None and position < len(args) and args[position] is not None


def install_chunked_loss(model: nn.Module, chunk_tokens: int) -> None:
    """Swap `model`'s LM head (get_output_embeddings, at every path it is reached by) for a chunked one and its
    `loss_function` for the chunked loss; a training forward given labels then never computes the logits
    whole. Refused, naming the fix, where it would not be exact (pure: the same error on every rank)."""
    check_chunk_tokens(chunk_tokens)
    name = type(model).__name__
    head = model.get_output_embeddings()
    if head is None or not uses_causal_lm_loss(model):
        raise NotImplementedError(f"loss_chunk_tokens: {name} does not compute a causal-LM loss through "
                                  "transformers' loss_function from one LM head; leave loss_chunk_tokens=None")
    config = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        value = getattr(config, attr, None)
        if value not in (None, 1, 1.0):
            raise NotImplementedError(f"loss_chunk_tokens with {name} (config.{attr}={value}): its forward transforms "
                                      "the logits before the loss, which the chunked loss does not; leave "
                                      "loss_chunk_tokens=None")
    pending = _Pending()
    if isinstance(head, VocabParallelLMHead):
        if not head.parallel_output:
            raise ValueError(f"loss_chunk_tokens with parallel_output=False ({name}): the chunked loss runs on the "
                             "vocabulary shards; pass parallel_output=True or loss_chunk_tokens=None")
        new = ChunkedVocabParallelLMHead.from_parallel(head, pending, chunk_tokens)
    elif type(head) is nn.Linear:
        new = ChunkedLinearHead.from_native(head, pending, chunk_tokens)
    else:
        raise NotImplementedError(f"loss_chunk_tokens: {name}'s LM head is a {type(head).__name__}, not a plain "
                                  "nn.Linear (an adapter, a quantised layer?); leave loss_chunk_tokens=None")
    for path in [p for p, m in model.named_modules(remove_duplicate=False) if m is head]:
        model.set_submodule(path, new)
    names = list(inspect.signature(model.forward).parameters)
    position = names.index("labels") if "labels" in names else None

    def arm(module, args, kwargs):
        pending.armed.set(module.training and _labels_given(position, args, kwargs))

    def disarm(_module, _args, _kwargs, _output):
        pending.armed.set(False)
        pending.stand_in = pending.hidden = None

    model.register_forward_pre_hook(arm, with_kwargs=True)
    model.register_forward_hook(disarm, with_kwargs=True, always_call=True)
    model.loss_function = _chunked_causal_lm_loss(model.loss_function, new, pending)


def _chunked_causal_lm_loss(previous, head: nn.Module, pending: _Pending):
    """transformers' causal-LM loss signature; the chunked loss on the head's stand-in, `previous` otherwise."""

    def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None,
                       **kwargs):
        if pending.stand_in is None:
            return previous(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,
                            ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)
        if logits is not pending.stand_in:
            raise NotImplementedError("loss_chunk_tokens: the model's forward changed the LM head's logits before its "
                                      "loss, which the chunked loss cannot follow; leave loss_chunk_tokens=None")
        hidden, pending.stand_in, pending.hidden = pending.hidden, None, None
        if shift_labels is None:
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        losses = head_token_losses(head, hidden, shift_labels, vocab_size, ignore_index)
        return reduce_token_losses(losses, shift_labels, ignore_index, "mean", num_items_in_batch)

    return causal_lm_loss
