"""DDP communication hooks: the default all-reduce, reported to `meshboost.distributed.profiling` so
data-parallel traffic is counted like tensor-parallel traffic (numerically identical to DDP's
default), and the fp8-compressed all-reduce of `fp8_communication=True` (meshboost.distributed.fp8).

torch's own default hook only ever waits on each bucket's future, never on the collective's work, and
ProcessGroupNCCL keeps the tensors of an async collective (the bucket) until its work is waited: its
watchdog hands them to the group, which lets go only at that group's next collective. A model boosted
under DDP therefore stayed on the GPU after it was dropped (one fp32 copy of the gradients, 838 MiB for
a 0.2B Llama on an H100). The counting hook waits every work it started at the end of the backward
that started it, as DDP finalizes its own buckets."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshboost.distributed.fp8 import fp8_allreduce_hook
from meshboost.distributed.profiling import record_collective


class CountingAllReduce:
    """The hook's state: the group (None = the world) and the works started in this backward."""

    def __init__(self, process_group):
        self.process_group = process_group
        self.pending: list = []
        self.waited = 0                     # works waited so far (tests read it)

    def finish(self) -> None:
        """Wait every work started so far (after DDP's own finalize they are complete: free)."""
        pending, self.pending = self.pending, []
        for work in pending:
            work.wait()
        self.waited += len(pending)

    def track(self, work) -> None:
        self.pending.append(work)
        if len(self.pending) == 1:
            try:                            # runs once the backward that called the hook is done
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            except RuntimeError:            # called outside a backward (DDP's join shadows): wait now
                self.finish()


def _counting_allreduce(state: CountingAllReduce, bucket):
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    record_collective("all_reduce", state.process_group, buffer)
    work = dist.all_reduce(buffer.div_(group.size()), group=group, async_op=True)
    state.track(work)
    return work.get_future().then(lambda future: future.value()[0])


def register_counting_allreduce(ddp: DistributedDataParallel, process_group) -> CountingAllReduce:
    """Install the counting all-reduce (mean over `process_group`; None = the world); returns its state."""
    state = CountingAllReduce(process_group)
    ddp.register_comm_hook(state, _counting_allreduce)
    ddp.meshboost_allreduce = state         # DDP keeps a hook's state in C++ only
    return state


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
