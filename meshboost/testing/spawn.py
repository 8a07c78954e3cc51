"""Start N processes with a process group once, and run a test body in each.

Use one `spawn` per test module (per world size) and loop cheap configurations inside the body:
a configuration costs milliseconds. The processes are forked from one fork server per parent process
(Linux), which imported torch, transformers and meshboost once: a fresh interpreter per process
re-imports them (~14 s of CPU for 4 processes on 2 cores, every spawn), a fork costs ~0.1 s. The
children get the caller's environment as it is at the call (a fork server keeps its own). gloo on CPU,
NCCL when CUDA is present (from the environment, never hard-coded; the fork server never touches CUDA).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import socket
import sys
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server, so every forked test process starts with them loaded.
_PRELOAD = ["torch", "torch.distributed", "transformers", "meshboost", "meshboost.plugins", "meshboost.testing.models"]
_START_METHOD = "forkserver" if sys.platform == "linux" else "spawn"


def _worker(rank: int, world_size: int, port: int, fn, args, kwargs, env=None):
    if env is not None:                 # the caller's environment now (the fork server's is older)
        os.environ.clear()
        os.environ.update(env)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)          # N processes on 2 cores: avoid oversubscription
    from meshboost.distributed.launch import launch
    launch(rank, world_size, "127.0.0.1", port, local_rank=rank, seed=1024)
    try:
        fn(rank, world_size, *args, **kwargs)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        # Sharded models keep their process groups alive through reference cycles (hooks, modules);
        # left to interpreter shutdown, a gloo group is torn down with its threads still joinable and
        # the process aborts ("terminate called without an active exception", ~1 run in 8). Collect
        # them while the interpreter is whole.
        gc.collect()
        dist.destroy_process_group()


def spawn(fn, nprocs: int, *args, **kwargs) -> None:
    """Run `fn(rank, world_size, *args, **kwargs)` in `nprocs` new processes sharing one process
    group; re-raises the first failure. `fn` must be importable (module level)."""
    if _START_METHOD == "forkserver":
        multiprocessing.set_forkserver_preload(_PRELOAD)     # read when the server starts (first call)
    mp.start_processes(_worker, args=(nprocs, free_port(), fn, args, kwargs, dict(os.environ)), nprocs=nprocs,
                       join=True, start_method=_START_METHOD)
