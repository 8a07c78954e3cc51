"""Asynchronous training-checkpoint saves: the write and the commit of one step in a background
thread while training goes on, at most one in flight.

Owns: `AsyncSaver` (one per booster: the host buffers a save stages into, reused by the next; the
writer thread; the failure it leaves for the next call; the gloo group its ranks agree over).

Why a separate gloo group, created once on the main thread (the first asynchronous save, a point
every rank reaches in the same order): the commit must wait until every rank's files are durable,
which needs an agreement between the ranks' writer threads; on the training group it could
interleave with the training's own collectives (NCCL and gloo match collectives by order, per
group), so it runs on a group nobody else uses, on the CPU. Committing at the next save or wait on
the main thread instead would leave each step uncommitted for a whole save interval after its files
were durable: a crash in between would lose it.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
from typing import Callable

import torch
import torch.distributed as dist

from meshboost.checkpoint.file_log import HostBuffers

logger = logging.getLogger("meshboost.checkpoint")
_AGREEMENT_TIMEOUT = datetime.timedelta(minutes=30)     # a rank whose writer died fails the others' commit


class AsyncSaver:
    """The asynchronous saves of one booster. `start(work)` runs `work` (the write and the commit,
    joining the other ranks' threads) in a thread; `wait()` joins it and raises what it raised, on
    every rank (the ranks' threads agree on failures before they end)."""

    def __init__(self):
        self.buffers = HostBuffers()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._groups: dict[tuple, object] = {}
        self._reported = False

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def roles_for(self, roles):
        """`roles` with the writer threads' own gloo group (created on the first call: every rank of
        `roles.group` must call, on the main thread) and CPU agreement tensors."""
        if roles.group is None:
            return roles
        ranks = tuple(dist.get_process_group_ranks(roles.group))
        if ranks not in self._groups:
            self._groups[ranks] = dist.new_group(list(ranks), backend="gloo", timeout=_AGREEMENT_TIMEOUT)
        return dataclasses.replace(roles, group=self._groups[ranks], device=torch.device("cpu"))

    def start(self, work: Callable[[], None], what: str) -> None:
        if self.busy:
            raise RuntimeError("an asynchronous checkpoint save is already in flight; wait() for it first")
        self._error = None
        self._thread = threading.Thread(target=self._run, args=(work, what), name="meshboost-checkpoint-writer")
        self._thread.start()     # not a daemon: a script that ends without wait() still finishes the write

    def _run(self, work: Callable[[], None], what: str) -> None:
        try:
            work()
        except BaseException as e:  # noqa: BLE001 - kept for the main thread's next call
            self._error = e
            logger.error("asynchronous %s failed (raised at the next save or wait_for_checkpoint): %s: %s",
                         what, type(e).__name__, e)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed or has failed; raise its failure (once)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error

    def report(self, step: int, rank: int) -> None:
        """Say how much host memory staging holds: printed by the first save, logged by later ones."""
        kind = (f"pinned host memory ({self.buffers.nbytes / 2**20:.1f} MiB staged, each buffer rounded up to a "
                "power of two by torch's pinned allocator)" if self.buffers.pinned else "host memory")
        line = (f"meshboost: asynchronous save of step {step} holds {self.buffers.held / 2**20:.1f} MiB of {kind} on "
                f"rank {rank} (this rank's share of one step, in buffers the next save reuses)")
        if not self._reported:
            print(line, flush=True)
            self._reported = True
        else:
            logger.info(line)
