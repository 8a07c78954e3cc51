"""CollectiveTally: the payload bytes and calls of chosen collectives, split by phase (forward, or
backward: inside an autograd node), for the benchmarks whose formulas tell the phases or payloads
apart (moe_ep.py, context_parallel.py). It wraps `comm.record_collective` while `listen()` is active,
so it sees exactly what `meshboost.distributed.profiling.comm_counter` counts, and passes every call on."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Callable

import torch


class CollectiveTally:
    """`classify(op, group, tensor)` names the payload a recorded collective counts under (None: not
    counted); bytes and calls accumulate under f"{name}_{phase}"."""

    def __init__(self, classify: Callable[[str, object, torch.Tensor], str | None]):
        self.classify = classify
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def listen(self):
        from meshboost.distributed import comm
        original = comm.record_collective

        def record(op, group, tensor):
            name = self.classify(op, group, tensor) if torch.is_tensor(tensor) else None
            if name is not None:
                phase = "backward" if torch._C._current_autograd_node() is not None else "forward"
                self.bytes[f"{name}_{phase}"] += tensor.numel() * tensor.element_size()
                self.calls[f"{name}_{phase}"] += 1
            original(op, group, tensor)

        comm.record_collective = record
        try:
            yield self
        finally:
            comm.record_collective = original
