"""How a step's loss is normalised when its batch is split over micro-batches and data-parallel
replicas, so that every layout trains the single-process objective.

Owns: the two modes and the item count. "tokens" (default): each micro-batch's loss, a mean over
its labelled items (real tokens; samples for sequence labels), is weighted by its share of the
items of the whole global batch (every micro-batch of every dp replica), which is what one process
computes on the whole batch; the count is agreed with one all-reduce over dp per step (or handed in:
execute_pipeline agrees it with its step's other verdicts). "microbatch":
the mean of micro-batch means, ColossalAI's convention, which trains another objective when
micro-batches hold different numbers of real tokens (padding). Must not know schedules or models:
whether labels are shifted (causal LMs) is the caller's knowledge.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from meshboost.distributed import comm
from meshboost.distributed.inputs import count_items

TOKENS, MICROBATCH = "tokens", "microbatch"
MODES = (TOKENS, MICROBATCH)


def batch_items(batch, shifted: bool) -> torch.Tensor | None:
    """The labelled items of a dict batch (its `labels`), or None when it carries no labels."""
    if not (isinstance(batch, Mapping) and torch.is_tensor(batch.get("labels"))):
        return None
    return count_items(batch["labels"], shifted)


def microbatch_weights(microbatches: list, shifted: bool, dp_group, dp_size: int,
                       total: float | None = None) -> torch.Tensor | None:
    """The weight of each micro-batch's mean loss for mode "tokens": weight_m =
    items_m * dp_size / items of the global batch, so sum_m weight_m * mean_m, averaged over dp by
    the gradient reduction, is the mean over every labelled item of the global batch. None when the
    micro-batches carry no `labels` (the caller then averages micro-batch means: exact for
    equal-sized micro-batches of sample-level losses). `total`: the items of the global batch when
    the caller agreed them already; otherwise one all-reduce over `dp_group`. A micro-batch without
    a labelled item weighs 0 (its mean, 0/0, must be masked by the caller)."""
    if not all(isinstance(mb, Mapping) and torch.is_tensor(mb.get("labels")) for mb in microbatches):
        return None
    counts = torch.stack([count_items(mb["labels"], shifted) for mb in microbatches]).double()
    if total is None:
        total = counts.sum().reshape(1)
        if dp_size > 1:
            comm.all_reduce(total, dp_group)
        total = total[0]
    return counts * dp_size / total
