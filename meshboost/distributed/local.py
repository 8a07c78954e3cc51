"""Processes on this machine sharing one process group, for tools that measure it (the planner's
calibration) and for the tests' spawn helper (`meshboost.testing.spawn` adds its fork server's preloads).

Owns: `free_port` and `spawn(fn, nprocs, *args)`: `nprocs` new processes, each given the torchrun
environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and the caller's environment as it
is at the call, one intra-op thread each (as torchrun gives several processes), started with
`meshboost.distributed.launch.launch` (gloo on CPU, NCCL on CUDA), running `fn(rank, world_size, *args)`
and tearing the group down. Must not know what runs in them. Training runs under torchrun, not this.
"""

from __future__ import annotations

import gc
import os
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args, kwargs, env=None):
    if env is not None:                 # the caller's environment at the call (a fork server's is older)
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    torch.set_num_threads(1)          # N processes sharing the cores (torchrun's OMP_NUM_THREADS=1)
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


def start(fn, nprocs: int, args: tuple = (), kwargs: dict | None = None, env: dict | None = None,
          start_method: str = "spawn") -> None:
    """`spawn` with its pieces apart: `env` the children's environment (default: the caller's now),
    `start_method` torch.multiprocessing's ("forkserver" with preloads: `meshboost.testing.spawn`)."""
    env = dict(os.environ) if env is None else env
    mp.start_processes(_worker, args=(nprocs, free_port(), fn, tuple(args), kwargs or {}, env), nprocs=nprocs,
                       join=True, start_method=start_method)


def spawn(fn, nprocs: int, *args, **kwargs) -> None:
    """Run `fn(rank, world_size, *args, **kwargs)` in `nprocs` new processes sharing one process
    group; re-raises the first failure. `fn` must be importable (module level)."""
    start(fn, nprocs, args, kwargs)
