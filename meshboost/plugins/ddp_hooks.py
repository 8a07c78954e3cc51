"""DDP communication hooks: the default all-reduce, reported to `meshboost.distributed.profiling` so
data-parallel traffic is counted like tensor-parallel traffic (numerically identical to DDP's
default), and the fp8-compressed all-reduce of `fp8_communication=True` (meshboost.distributed.fp8)."""

from __future__ import annotations

from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from meshboost.distributed.fp8 import fp8_allreduce_hook
from meshboost.distributed.profiling import record_collective


def _counting_allreduce(process_group, bucket):
    record_collective("all_reduce", process_group, bucket.buffer())
    return default_hooks.allreduce_hook(process_group, bucket)


def register_counting_allreduce(ddp: DistributedDataParallel, process_group) -> None:
    """Install the counting all-reduce (mean over `process_group`; None = the world)."""
    ddp.register_comm_hook(process_group, _counting_allreduce)


def register_fp8_allreduce(ddp: DistributedDataParallel, process_group) -> None:
    """Install the fp8-compressed mean over `process_group` (lossy: see meshboost.distributed.fp8)."""
    ddp.register_comm_hook(process_group, fp8_allreduce_hook)


def fp8_refusal(device_type: str, plugin: str) -> str | None:
    """Why `fp8_communication=True` is refused on this device, or None where it runs (CUDA)."""
    if device_type == "cuda":
        return None
    return (f"{plugin}(fp8_communication=True) compresses data-parallel gradient all-reduces to fp8 for NCCL on "
            f"CUDA; this process computes on {device_type!r}, where it is refused (gloo has no fp8 type, and a CPU "
            "run is not link-bound). Drop the argument; 16-bit gradient reductions come from training in 16 bits "
            "(precision='bf16')")
