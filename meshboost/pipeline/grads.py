"""Gradient reductions a pipeline step owes after its schedule ran.

Owns: summing the gradients of weights that several pipeline ranks hold (GPT-2's `wte` / `lm_head`
on the first and last stage; T5's shared embedding on the encoder's first, the decoder's first and
the last stage) over the group joining those ranks (`ParallelMesh.stage_group`), and averaging
stage gradients over the data-parallel group when the plugin decided the pipeline reduces them.
Collectives go through `meshboost.distributed.comm`. Must not know about schedules.

Why not DDP around a stage: DDP reduces during every backward (one per micro-batch unless told
otherwise) and expects each forward to reach its end, which a stage's forward does not; one
flat all-reduce after the schedule is simpler and moves the same bytes once.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from meshboost.distributed import comm


def _flat_all_reduce(params: list[torch.nn.Parameter], group, average: bool) -> None:
    """All-reduce the gradients of `params` over `group`, one flat buffer per dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    seen: set[int] = set()
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            by_dtype[p.grad.dtype].append(p.grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group)
        if average:
            flat.div_(dist.get_world_size(group))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_tied_grads(params: list[torch.nn.Parameter], group) -> None:
    """Tied weights get the sum of both stages' gradients, as the single tied weight would."""
    _flat_all_reduce(params, group, average=False)


def average_grads(params, dp_group) -> None:
    """Average gradients over the data-parallel replicas (what DDP does without a pipeline)."""
    _flat_all_reduce(list(params), dp_group, average=True)
