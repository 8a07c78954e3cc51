"""Mixture-of-experts layers on the planner's fake run (activations.py): what one rank's experts
compute and exchange, shape for shape.

Owns:
- `fake_grouped_mm`: transformers' grouped-mm experts path on fake tensors (torch's meta kernel
  refuses fp32 experts);
- `install_expert_parallel`: expert parallelism as `shard_expert_parallel_` deals it out (ep rank 0's
  E / ep experts, their gradient hook) with meshboost's own dispatching forward
  (`ExpertParallelForward`: the sort by expert, the rows sent, the local experts on the rows received,
  the rows sent back and combined by the routing weights), its all-to-alls shape-only. The rows a rank
  receives are data (the router's choice); the fake run assumes balanced routing: every expert gets
  the same share of the ep group's tokens x top-k rows, so each rank receives as many rows as it sends
  (tokens x top-k) and each ep rank an equal part of them. A router that sends a rank more rows makes
  that rank hold more than predicted (the dispatched rows scale with what it receives).
Must not communicate.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn as nn

from meshboost.plan.emulate import _RowsExchange
from meshboost.shardformer.layers.experts import experts_forward, set_experts_forward


class _GroupedMM(torch.autograd.Function):
    """`grouped_mm(input [S, in], weight [E, in, out], offs)` on fake tensors: the output's shape and
    what autograd saves (input, weight, offs), without torch's meta kernel, which checks CUDA's dtype
    rules (bf16 only) and so refuses the fp32 experts a CPU run computes."""

    @staticmethod
    def forward(ctx, input, weight, offs):
        ctx.save_for_backward(input, weight, offs)
        return input.new_empty((input.shape[0], weight.shape[-1]))

    @staticmethod
    def backward(ctx, grad):
        input, weight, _ = ctx.saved_tensors
        return torch.empty_like(input), torch.empty_like(weight), None


@contextmanager
def fake_grouped_mm():
    """transformers' grouped-mm experts path (`torch.nn.functional.grouped_mm`) routed through
    `_GroupedMM` while the fake forward runs: the token count per expert is data, so only shapes
    matter (tokens x top-k rows in all, whatever the routing)."""
    original = getattr(torch.nn.functional, "grouped_mm", None)
    if original is None:
        yield
        return

    def grouped_mm(input, weight, offs=None, **kwargs):
        if input.dim() == 2 and weight.dim() == 3 and offs is not None and not kwargs:
            return _GroupedMM.apply(input, weight, offs)
        return original(input, weight, offs=offs, **kwargs)

    torch.nn.functional.grouped_mm = grouped_mm
    try:
        yield
    finally:
        torch.nn.functional.grouped_mm = original


def _shares(total: int, parts: int) -> list[int]:
    """`total` split into `parts` as evenly as integers allow."""
    return [total // parts + (i < total % parts) for i in range(parts)]


def install_expert_parallel(model: nn.Module, ep_size: int) -> None:
    """`model`'s experts dealt out over `ep_size` ranks as ep rank 0 holds them, dispatching with
    shape-only exchanges under balanced routing (see the module docstring). Before the weights are
    noted: the experts' weights are new (sliced) tensors."""
    from meshboost.shardformer.layers.expert_parallel import ExpertParallelForward, shard_expert_parallel_

    class BalancedExchange(ExpertParallelForward):
        def _exchange(self, x, output_sizes, input_sizes):
            return _RowsExchange.apply(x, output_sizes, input_sizes)

        def _block_sizes(self, hidden, send_sizes):
            return list(send_sizes)          # every rank holds as many tokens

        def _routed_sizes(self, module, ids, flat, bad):
            sizes = _shares(flat.numel(), self.ep_size)          # rows to each rank, as many from each
            counts = [n for size in sizes for n in _shares(size, self.local)]
            return sizes, list(sizes), flat.new_tensor(counts)

    shard_expert_parallel_(model, None, ep_size, 0)
    for module in model.modules():
        record = experts_forward(module)
        if record.ep is not None:
            fields = {f.name: getattr(record.ep, f.name) for f in dataclasses.fields(record.ep)}
            set_experts_forward(module, ep=BalancedExchange(**fields))
