"""Time spent in collectives for a peer that does not call meshboost's `comm.py` (DTensor): a
TorchDispatchMode that reads the clock around every c10d / functional collective and every
`wait_tensor` reaching torch's dispatcher.

Owns: `dispatched_wait_timer()`, filling a `profiling.WaitTimer` in the same units as meshboost's own
timer: blocked_s (the caller waited: a collective op's own call, or `wait_tensor`), overlapped_s
(functional collectives in flight from their start to their `wait_tensor`). A Python hook on every
op makes the step slower: use it in a step that is not timed. Must not issue communication itself.
"""

from __future__ import annotations

import contextlib
import time

import torch

from meshboost.distributed.profiling import WaitTimer

_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def _mode_class():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _WaitClock(TorchDispatchMode):
        def __init__(self, timer: WaitTimer):
            super().__init__()
            self.timer = timer
            self.started: dict[int, float] = {}      # id of a functional collective's output -> start time

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented        # let DTensor desugar into collectives first
            timed = isinstance(func, torch._ops.OpOverload) and func.namespace in _COLLECTIVE_NAMESPACES
            if not timed:
                return func(*args, **kwargs)
            name = func._schema.name.split("::")[-1]
            if name == "wait_tensor" and args and id(args[0]) in self.started:
                self.timer.overlapped_s += time.perf_counter() - self.started.pop(id(args[0]))
            start = time.perf_counter()
            out = func(*args, **kwargs)
            now = time.perf_counter()
            self.timer.blocked_s += now - start
            if func.namespace != "c10d" and name != "wait_tensor" and torch.is_tensor(out):
                self.started[id(out)] = now
            return out

    return _WaitClock


@contextlib.contextmanager
def dispatched_wait_timer():
    """Time every collective reaching torch's dispatcher inside the block (see the module docstring)."""
    timer = WaitTimer()
    with _mode_class()(timer):
        yield timer
