"""Process-group start-up from the torchrun environment.

Owns: reading RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, choosing the backend and device,
the collective timeout (argument, else MESHBOOST_DIST_TIMEOUT seconds, else torch's default) and
seeding every random generator. Must not build parallel groups (that is `ParallelMesh`, which
gives its groups the default group's timeout).
"""

from __future__ import annotations

import atexit
import datetime
import functools
import gc
import logging
import os
import random
import warnings

import numpy as np
import torch
import torch.distributed as dist

_REQUIRED_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "MESHBOOST_DIST_TIMEOUT"      # seconds; torch itself reads no such variable


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


def resolve_timeout(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    """The collective timeout to use: `timeout` (a timedelta or seconds), else the environment's
    MESHBOOST_DIST_TIMEOUT (seconds), else None (torch's default: 10 min NCCL, 30 min gloo).
    Pure: the same answer and the same error on every rank."""
    source = "timeout"
    if timeout is None and os.environ.get(TIMEOUT_ENV, "").strip():
        timeout, source = os.environ[TIMEOUT_ENV].strip(), f"{TIMEOUT_ENV}"
        try:
            timeout = float(timeout)
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={timeout!r} is not a number of seconds; set it to e.g. 600") from None
    if timeout is None:
        return None
    given = timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        timeout = datetime.timedelta(seconds=timeout)
    if not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(f"{source}={given!r} must be a positive number of seconds or datetime.timedelta "
                         "(torch reads 0 as 'expire at once')")
    return timeout


def launch(rank: int, world_size: int, host: str, port: int | str, backend: str | None = None,
           local_rank: int | None = None, seed: int = 1024, verbose: bool = False,
           timeout: datetime.timedelta | float | None = None, cpu_shared_memory: bool | None = None) -> None:
    """Initialise the default process group from explicit values (ColossalAI's `launch`, same order:
    rank, world_size, host, port, backend, local_rank, seed, verbose). backend: None chooses NCCL with
    CUDA and gloo without. local_rank: the CUDA device index on this node (default: LOCAL_RANK from
    the environment, else rank modulo the node's device count). `timeout`: see `resolve_timeout`;
    every group the mesh builds inherits it. verbose: rank 0 logs the backend, world and device.
    `cpu_shared_memory`: accepted and ignored, with a one-time warning (see `_warn_shared_memory_ignored`)."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"launch: {name}={value!r} must be an int (ColossalAI's order is rank, world_size, "
                            "host, port, backend, local_rank, seed)")
    if not 0 <= rank < world_size:
        raise ValueError(f"launch: rank={rank} is outside world_size={world_size}")
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = backend or default_backend()
    timeout = resolve_timeout(timeout)
    if cpu_shared_memory is not None:
        _warn_shared_memory_ignored()
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA, but torch.cuda.is_available() is False; "
                           "pass backend='gloo' (or None to choose automatically)")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    if not dist.is_initialized():
        atexit.register(_shutdown)
        kwargs = {"timeout": timeout} if timeout is not None else {}
        store = _elastic_attempt_store(host, port, world_size, timeout)
        if store is not None:
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, **kwargs)
        else:
            dist.init_process_group(backend=backend, init_method=f"tcp://{host}:{port}", rank=rank,
                                    world_size=world_size, **kwargs)
    set_seed(seed)
    if verbose and dist.get_rank() == 0:
        logging.getLogger("meshboost").warning("meshboost: launched %d processes, backend %s, device %s, seed %d",
                                               dist.get_world_size(), dist.get_backend(), get_current_device(), seed)


def _shutdown() -> None:
    """At interpreter exit, while it is still whole: free the groups that sharded models keep alive
    through reference cycles and destroy the default group. Left to finalization, gloo groups are
    torn down with joinable threads and the process aborts ("terminate called without an active
    exception": 2 of 10 four-rank runs of a plain training script before this hook)."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def _elastic_attempt_store(host: str, port, world_size: int, timeout: datetime.timedelta | None):
    """Under torchrun with its agent's shared TCP store (TORCHELASTIC_USE_AGENT_STORE=True, torch's
    default), a restarted attempt would meet the keys the dead attempt left in that store and gloo's
    connectFullMesh fails or hangs; a store prefixed by the attempt number (TORCHELASTIC_RESTART_COUNT)
    keeps each attempt's keys apart. None outside that setting (torch's own rendezvous is fine)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(host, int(port), world_size, is_master=False,
                          timeout=timeout or datetime.timedelta(minutes=30))
    return dist.PrefixStore(f"meshboost/attempt-{attempt}", store)


def launch_from_torch(seed: int = 1024, backend: str | None = None,
                      timeout: datetime.timedelta | float | None = None, verbose: bool = False,
                      config=None, cpu_shared_memory: bool | None = None) -> None:
    """Initialise the default process group from the environment `torchrun` sets.

    Uses NCCL when CUDA is available and gloo otherwise (or `backend`), binds this process to
    cuda:LOCAL_RANK, and seeds Python, NumPy and torch with `seed` on every rank. `timeout` (a
    timedelta or seconds; default: the MESHBOOST_DIST_TIMEOUT environment variable, else torch's
    10 min for NCCL and 30 min for gloo) bounds every collective: a stalled peer makes the others
    raise `CollectiveTimeout` after it instead of hanging. verbose: rank 0 logs the backend, world
    size and device once (ColossalAI's keyword). `config` (older ColossalAI tutorials pass
    `config={}` or a config file, first positionally) is ignored with a one-time warning, as
    ColossalAI did when it dropped the argument; a dict or path given as `seed` is taken for it.
    `cpu_shared_memory`: accepted and ignored, as in `launch`.
    """
    if isinstance(seed, (dict, str, os.PathLike)):       # launch_from_torch({}) / ("config.py")
        seed, config = 1024, seed
    if config is not None:
        _warn_config_ignored()
    missing = [k for k in _REQUIRED_ENV if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"launch_from_torch: environment variables {missing} are not set; start the script with "
            "`torchrun --nproc_per_node N script.py` (or set RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT yourself)")
    launch(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), host=os.environ["MASTER_ADDR"],
           port=os.environ["MASTER_PORT"], backend=backend, local_rank=int(os.environ["LOCAL_RANK"]), seed=seed,
           verbose=verbose, timeout=timeout, cpu_shared_memory=cpu_shared_memory)


@functools.cache
def _warn_config_ignored() -> None:
    """Once per process: `config=` of older ColossalAI releases has no effect here."""
    warnings.warn("launch_from_torch(config=...) is ignored: meshboost (like ColossalAI >= 0.3.5) takes the "
                  "layout from the plugin, e.g. HybridParallelPlugin(tp_size=2); drop the argument", FutureWarning,
                  stacklevel=3)


@functools.cache
def _warn_shared_memory_ignored() -> None:
    """Once per process: the CPU shared-memory transport that `cpu_shared_memory=` switched was removed
    (issue 57). Every CPU collective runs on the backend (gloo): what `False` asked for, and the results
    `True` was built to match, so refusing the keyword would stop a script for nothing; it goes in the
    next release."""
    warnings.warn("launch(cpu_shared_memory=...) is ignored: meshboost no longer has its own CPU transport and "
                  "every collective runs on the backend (gloo on CPU, NCCL on CUDA); drop the argument",
                  FutureWarning, stacklevel=3)


def group_timeout(group=None) -> datetime.timedelta | None:
    """The timeout `group` (default: the world) was created with, where the backend says."""
    device = get_current_device()
    try:
        return group_or_world(group)._get_backend(device).options._timeout
    except (AttributeError, RuntimeError):
        return None


def group_or_world(group):
    return dist.group.WORLD if group is None else group
