"""Process-group start-up from the torchrun environment.

Owns: reading RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, choosing the backend and device,
and seeding every random generator. Must not build parallel groups (that is `ParallelMesh`).
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def get_current_device() -> torch.device:
    """The device this process computes on: its CUDA device when CUDA is available, else the CPU.

    `ParallelMesh` reads it once (`mesh.device`); code that holds a mesh asks the mesh instead."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    """NCCL when CUDA is available, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def set_seed(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) with the same value."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def launch(rank: int, world_size: int, local_rank: int, host: str, port: int | str,
           backend: str | None = None, seed: int = 1024) -> None:
    """Initialise the default process group from explicit values (used by tests and by
    `launch_from_torch`)."""
    backend = backend or default_backend()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA, but torch.cuda.is_available() is False; "
                           "pass backend='gloo' (or None to choose automatically)")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=f"tcp://{host}:{port}",
                                rank=rank, world_size=world_size)
    set_seed(seed)


def launch_from_torch(seed: int = 1024, backend: str | None = None) -> None:
    """Initialise the default process group from the environment `torchrun` sets.

    Uses NCCL when CUDA is available and gloo otherwise (or `backend`), binds this process to
    cuda:LOCAL_RANK, and seeds Python, NumPy and torch with `seed` on every rank.
    """
    missing = [k for k in _REQUIRED_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"launch_from_torch: environment variables {missing} are not set; start the script with "
            "`torchrun --nproc_per_node N script.py` (or set RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT yourself)")
    launch(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
           local_rank=int(os.environ["LOCAL_RANK"]), host=os.environ["MASTER_ADDR"],
           port=os.environ["MASTER_PORT"], backend=backend, seed=seed)
