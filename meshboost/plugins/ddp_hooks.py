"""DDP communication hook that reports its all-reduces to `meshboost.distributed.profiling`, so
data-parallel traffic is counted like tensor-parallel traffic. Numerically identical to DDP's
default."""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from meshboost.distributed.profiling import record_collective


def _counting_allreduce(process_group, bucket):
    record_collective("all_reduce", process_group, bucket.buffer())
    return default_hooks.allreduce_hook(process_group, bucket)


def register_counting_allreduce(ddp: DistributedDataParallel, process_group) -> None:
    """Install the counting all-reduce (mean over `process_group`; None = the world)."""
    ddp.register_comm_hook(process_group, _counting_allreduce)
