"""DistCoordinator: ColossalAI's "who am I, who prints, who waits" helper over torch.distributed.

Owns: answering rank / world size / local rank, master and last-process checks (optionally within
a group), printing on one rank, barriers and one-rank-first execution. Must not hold process-wide
state: unlike ColossalAI's it is not a singleton (STYLE.md §4); every instance reads the same
process group, so two instances always agree.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch.distributed as dist


class DistCoordinator:
    """rank, world_size (of the default group) and local_rank (torchrun's LOCAL_RANK, -1 when unset).

    >>> coordinator = DistCoordinator()
    >>> coordinator.print_on_master(f"{coordinator.world_size} processes")
    """

    def __init__(self):
        if not dist.is_initialized():
            raise RuntimeError("DistCoordinator needs an initialised process group: call "
                               "meshboost.launch_from_torch() (or torch.distributed.init_process_group) first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", -1))

    def _need_local_rank(self) -> None:
        if self.local_rank < 0:
            raise RuntimeError("LOCAL_RANK is not set, so the node master is unknown; start the script with torchrun")

    def is_master(self, process_group: dist.ProcessGroup | None = None) -> bool:
        """Rank 0 of `process_group` (default: of the world)."""
        return dist.get_rank(group=process_group) == 0

    def is_node_master(self) -> bool:
        """Local rank 0: the first process of this node."""
        self._need_local_rank()
        return self.local_rank == 0

    def is_last_process(self, process_group: dist.ProcessGroup | None = None) -> bool:
        """The last rank of `process_group` (default: of the world)."""
        return dist.get_rank(group=process_group) == dist.get_world_size(group=process_group) - 1

    def print_on_master(self, msg: str, process_group: dist.ProcessGroup | None = None) -> None:
        if self.is_master(process_group):
            print(msg)

    def print_on_node_master(self, msg: str) -> None:
        if self.is_node_master():
            print(msg)

    def block_all(self, process_group: dist.ProcessGroup | None = None) -> None:
        """A barrier over `process_group` (default: the world)."""
        dist.barrier(group=process_group)

    @contextlib.contextmanager
    def priority_execution(self, executor_rank: int = 0, process_group: dist.ProcessGroup | None = None):
        """Rank `executor_rank` of the group runs the block first (a download, a cache build), the
        others wait for it and then run it; every rank of the group must enter."""
        first = dist.get_rank(group=process_group) == executor_rank
        if not first:
            self.block_all(process_group)
        yield
        if first:
            self.block_all(process_group)

    def on_master_only(self, process_group: dist.ProcessGroup | None = None):
        """Decorator: the function runs on the group's rank 0 only (elsewhere it returns None)."""
        master = self.is_master(process_group)

        def decorator(func):
            @functools.wraps(func)
            def wrapper(*args, **kwargs):
                return func(*args, **kwargs) if master else None
            return wrapper
        return decorator

    def destroy(self, process_group: dist.ProcessGroup | None = None) -> None:
        """Destroy `process_group` (default: the default group, and with it every group)."""
        dist.destroy_process_group(process_group)
