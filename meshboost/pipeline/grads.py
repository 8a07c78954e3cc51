"""Gradient reductions a pipeline step owes after its schedule ran.

Owns: summing the gradients of weights that several pipeline ranks hold (GPT-2's `wte` / `lm_head`
on the first and last stage; T5's shared embedding on the encoder's first, the decoder's first and
the last stage) over the group joining those ranks (`ParallelMesh.stage_group`), and averaging
stage gradients over the data-parallel group when the plugin decided the pipeline reduces them.
Collectives go through `meshboost.distributed.comm`. Must not know about schedules.

Why not DDP around a stage: DDP reduces during every backward (one per micro-batch unless told
otherwise) and expects each forward to reach its end, which a stage's forward does not; one
flat all-reduce after the schedule (`comm.all_reduce_grads`, one per group) is simpler and moves the
same bytes once.
"""

from __future__ import annotations

import torch

from meshboost.distributed import comm


def sum_tied_grads(params: list[torch.nn.Parameter], group) -> None:
    """Tied weights get the sum of both stages' gradients, as the single tied weight would."""
    comm.all_reduce_grads(params, group, average=False)


def average_grads(reductions) -> None:
    """Average gradients over their data-parallel replicas (what DDP does without a pipeline):
    `reductions` is [(params, group)], one entry per group (dense weights over dp, expert weights over
    their own replicas)."""
    for params, group in reductions:
        comm.all_reduce_grads(list(params), group, average=True)
