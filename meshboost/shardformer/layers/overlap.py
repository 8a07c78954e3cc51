"""Tensor-parallel communication hidden behind compute at a block's input (Megatron's asynchronous
input-gradient all-reduce), for blocks whose input feeds several column-parallel linears (q/k/v,
gate/up): the block's one collective runs while the weight gradients of those linears are computed.

Owns: `enter_block`, the block region's input collective with the overlap (Megatron's f, or under
sequence parallelism the all-gather along the sequence), and `DeferredColumns`, the per-call record
through which the column linears reading that input hand their weight-gradient products to it.

Why the weight gradients move: autograd runs a linear's input and weight gradients in one node, and
the block's collective can start only once every linear's input gradient has been summed. So a
column reading the block's input computes only its input (and bias) gradient in backward and leaves
(its output gradient, its input) here; the block's input node, which takes the columns' weights as
inputs, starts the all-reduce (reduce-scatter under sequence parallelism) asynchronously, computes the
weight gradients while it runs, returns them to autograd (so gradient hooks, DDP and ZeRO see them as
usual), and waits only then. The same products in the same dtype as autograd's; the same bytes.
Must not call `dist.*` (collectives come from `meshboost.distributed.comm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshboost.distributed import comm


class DeferredColumns:
    """One forward call of a block: the weights of the columns that may defer to it (`weights[i]`,
    `conv1d[i]`: GPT-2 Conv1D layout) and, filled in backward, each column's (output grad, input)."""

    def __init__(self, weights: list[torch.Tensor], conv1d: list[bool]):
        self.weights, self.conv1d = weights, conv1d
        self._stashed: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def index(self, weight: torch.Tensor) -> int | None:
        """The slot of `weight`, or None when this block did not take it."""
        return next((i for i, w in enumerate(self.weights) if w is weight), None)

    def stash(self, index: int, grad: torch.Tensor, x: torch.Tensor) -> None:
        self._stashed.setdefault(index, []).append((grad, x))

    def weight_grads(self, needed: tuple[bool, ...]) -> list[torch.Tensor | None]:
        """Each weight's gradient from the stashed products (None where no column deferred to it);
        the record is emptied, so a retained graph's second backward finds it fresh."""
        out = []
        for i, conv1d in enumerate(self.conv1d):
            total = None
            for grad, x in self._stashed.get(i, ()) if needed[i] else ():
                g = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))     # [out, in]
                g = g.t() if conv1d else g
                total = g if total is None else total + g
            out.append(total)
        self._stashed.clear()
        return out


class _EnterBlock(torch.autograd.Function):
    """forward: identity (all-gather along `dim` 1 under sequence parallelism); backward: the input
    gradient's all-reduce (reduce-scatter) started, the deferred weight gradients computed, then waited."""

    @staticmethod
    def forward(ctx, x, group, seq_parallel: bool, deferred: DeferredColumns, *weights):
        ctx.group, ctx.seq_parallel, ctx.deferred = group, seq_parallel, deferred
        return comm.all_gather(x, group, dim=1) if seq_parallel else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:          # nothing to reduce (no rank needs it): weight gradients only
            return (None, None, None, None, *ctx.deferred.weight_grads(ctx.needs_input_grad[4:]))
        grad = grad.contiguous()
        pending = comm.reduce_scatter_async(grad, ctx.group, dim=1) if ctx.seq_parallel \
            else comm.all_reduce_async(grad, ctx.group)
        weight_grads = ctx.deferred.weight_grads(ctx.needs_input_grad[4:])
        return (pending.wait(), None, None, None, *weight_grads)


class _DeferredColumn(torch.autograd.Function):
    """y = x W^T + b whose backward computes the input and bias gradients and leaves the weight's to
    the block's input node (`_EnterBlock`), which takes the weight as its input."""

    @staticmethod
    def forward(ctx, x, weight, bias, deferred: DeferredColumns, index: int, conv1d: bool):
        ctx.save_for_backward(x, weight)
        ctx.deferred, ctx.index, ctx.conv1d, ctx.has_bias = deferred, index, conv1d, bias is not None
        return F.linear(x, weight.t() if conv1d else weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        w = weight.t() if ctx.conv1d else weight                          # [out, in]
        grad_input = grad.matmul(w) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            ctx.deferred.stash(ctx.index, grad, x)
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias, None, None, None


def enter_block(x: torch.Tensor, group, seq_parallel: bool, columns: list) -> tuple[torch.Tensor, DeferredColumns]:
    """A block's input through its collective (Megatron's f; the sequence all-gather under sequence
    parallelism), with the weight gradients of `columns` (the column-parallel linears inside the
    block, live modules with `.weight` and `.conv1d`) deferred to it; returns (input, its record)."""
    deferred = DeferredColumns([c.weight for c in columns], [c.conv1d for c in columns])
    return _EnterBlock.apply(x, group, seq_parallel, deferred, *deferred.weights), deferred


def deferred_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deferred: DeferredColumns,
                    conv1d: bool) -> torch.Tensor | None:
    """The linear with its weight gradient left to the block's input node, or None when that block
    did not take this weight (the caller then runs the plain product)."""
    index = deferred.index(weight)
    if index is None:
        return None
    return _DeferredColumn.apply(x, weight, bias, deferred, index, conv1d)
