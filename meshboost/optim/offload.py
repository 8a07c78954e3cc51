"""CPU offload for ZeroOptimizer (ColossalAI's `cpu_offload=True`): this rank's master shards and the
optimizer states live in host memory, and the inner optimizer step runs on the CPU.

Owns: where master shards are allocated (`master_device`), one host staging buffer per bucket in the
working dtype (page-locked when the working device is CUDA, so both copies can run non_blocking), and
the two copies of a step: the reduced gradient shard to the host (after the overflow check and the
norm, which stay on the working device), and the updated shard, cast to the working dtype on the
host, back to the working device for the all-gather. Counts the copies and bytes it makes (tests and
benchmarks read them). Must not decide the step order (mixed_precision.py) or the layout (zero.py),
and must not communicate.
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")


def master_device(working: torch.device, cpu_offload: bool) -> torch.device:
    """Where a bucket's master shard (and so the optimizer's states for it) is allocated."""
    return HOST if cpu_offload else working


def _copies_async(device: torch.device) -> bool:
    """Copies between `device` and page-locked host memory can be queued without blocking the host
    (CUDA's copy engines); elsewhere a copy is synchronous."""
    return device.type == "cuda"


class HostStaging:
    """Host buffers in the working dtype, one per bucket (`key`), allocated on first use.

    A buffer carries the gradient shard down before the step and the updated shard up after it, so
    only working-dtype bytes cross the bus (half of fp32's under fp16/bf16). With fp32 working weights
    the master's `.grad` may alias the buffer; it is consumed by the step before the buffer is
    refilled.
    """

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._buffers: dict[object, torch.Tensor] = {}
        self._in_flight: dict[object, torch.cuda.Event] = {}    # host -> device copies still reading a buffer
        self.copies_to_host = self.copies_to_device = 0
        self.bytes_to_host = self.bytes_to_device = 0

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The host buffers allocated so far (they live from their first use on: a memory meter counts them)."""
        return list(self._buffers.values())

    def _buffer(self, key, numel: int, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.numel() != numel:
            buf = torch.empty(numel, dtype=self.dtype, device=HOST, pin_memory=_copies_async(device))
            self._buffers[key] = buf
        event = self._in_flight.pop(key, None)
        if event is not None:
            event.synchronize()      # the host is about to write a buffer a queued upload still reads
        return buf

    def to_host(self, shards: list[tuple[object, torch.Tensor]]) -> list[torch.Tensor]:
        """Each (key, working-device tensor) copied into its host buffer: every copy is queued first and
        the host waits once, before anything reads the buffers."""
        out, waits = [], set()
        for key, shard in shards:
            buf = self._buffer(key, shard.numel(), shard.device)
            buf.copy_(shard.detach().reshape(-1), non_blocking=_copies_async(shard.device))
            if _copies_async(shard.device):
                waits.add(shard.device)
            self.copies_to_host += 1
            self.bytes_to_host += buf.numel() * buf.element_size()
            out.append(buf)
        for device in waits:
            torch.cuda.current_stream(device).synchronize()
        return out

    def to_device(self, key, master: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`master` (on the host) cast to the working dtype on the host, then copied to `device` (queued
        where it can be: later work on the device's stream is ordered after it)."""
        buf = self._buffer(key, master.numel(), device)
        buf.copy_(master.detach().reshape(-1))
        self.copies_to_device += 1
        self.bytes_to_device += buf.numel() * buf.element_size()
        if device.type == "cpu":
            return buf
        out = buf.to(device, non_blocking=_copies_async(device))
        if _copies_async(device):
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._in_flight[key] = event
        return out

    def reset_counters(self) -> None:
        self.copies_to_host = self.copies_to_device = self.bytes_to_host = self.bytes_to_device = 0
