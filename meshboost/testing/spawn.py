"""Start N processes with a process group once, and run a test body in each.

Use one `spawn` per test module (per world size) and loop cheap configurations inside the body:
a configuration costs milliseconds. The processes are forked from one fork server per parent process
(Linux), which imported torch, transformers and meshboost once: a fresh interpreter per process
re-imports them (~14 s of CPU for 4 processes on 2 cores, every spawn), a fork costs ~0.1 s. The
children get the caller's environment as it is at the call (a fork server keeps its own). gloo on CPU,
NCCL when CUDA is present (from the environment, never hard-coded; the fork server never touches CUDA).
"""

from __future__ import annotations

import multiprocessing
import os
import sys

from meshboost.distributed.local import free_port, start

__all__ = ["spawn", "free_port"]

# Imported once by the fork server, so every forked test process starts with them loaded.
_PRELOAD = ["torch", "torch.distributed", "transformers", "meshboost", "meshboost.plugins", "meshboost.testing.models"]
_START_METHOD = "forkserver" if sys.platform == "linux" else "spawn"
_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}     # unless the caller's environment says


def spawn(fn, nprocs: int, *args, **kwargs) -> None:
    """Run `fn(rank, world_size, *args, **kwargs)` in `nprocs` new processes sharing one process
    group (`meshboost.distributed.local`, forked from the preloaded server); re-raises the first
    failure. `fn` must be importable (module level)."""
    if _START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)     # read when the server starts (first call)
    start(fn, nprocs, args, kwargs, env={**_OFFLINE, **os.environ}, start_method=_START_METHOD)
