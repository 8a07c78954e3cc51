"""A shared-memory all-reduce for CPU process groups whose ranks share one host.

Owns: deciding, once per group, whether its CPU all-reduces can go through shared memory instead of
gloo's loopback sockets, the segment that group maps, and the exchange itself. On this repository's
2-core test machine a 1 MB gloo all-reduce between two processes takes 2.0-3.4 ms of wall time and
1.1-1.9 ms of CPU (threads waking threads, socket copies), and a tensor-parallel step makes 20 of
them; through shared memory it is two memory copies and a flag. Must not change a number: every rank
sums the same slots in the same (rank) order, so all ranks get bitwise the same result, and at two
ranks the result is gloo's (a + b == b + a). Must not change what is counted: `comm.py` records the
collective before choosing the transport, and the witness (`profiling.dispatched_comm_counter`)
hears this transport as it hears torch's dispatcher.

The exchange, for round k of a group (every rank counts the same rounds):
  1. copy my chunk into my slot of buffer k % 2, write its size, the whole tensor's size and a code for
     its dtype and reduction beside my flag, set my flag to k;
  2. wait until every flag is >= k (a peer may already be at k + 1: it writes the other buffer);
  3. check every rank wrote what I wrote (a mismatch is a user error, refused on every rank in the same
     round, never summed), then reduce the slots in rank order into my tensor.
Two buffers suffice: a peer can write buffer k % 2 again only in round k + 2, which needs my flag
k + 1, which I set after I have read round k. The flag is written after the data by a separate
store, and x86-64 keeps stores (and loads) in order, so a flag seen means its data is there; other
architectures (weaker ordering) keep gloo. Not under torch.compile (dynamo traces the collective
itself), not for dtypes numpy cannot add (bfloat16) nor for reductions other than sum, max, min and
product: those keep gloo too.
"""

from __future__ import annotations

import os
import platform
import socket
import threading
import time
import uuid
import weakref

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

SLOT_BYTES = 4 * 2 ** 20      # per rank and buffer; larger tensors go through in chunks of this size
_LINE = 64                    # bytes: each rank's flag and, per buffer, its round's sizes and kind, on one cache line
_SHM_DIR = "/dev/shm"
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
                 torch.int64: np.int64, torch.int32: np.int32}
_OPS = {dist.ReduceOp.SUM: np.add, dist.ReduceOp.MAX: np.maximum, dist.ReduceOp.MIN: np.minimum,
        dist.ReduceOp.PRODUCT: np.multiply}
_TSO_MACHINES = ("x86_64", "amd64", "i686", "i386")     # stores and loads stay in program order

_enabled = True
# group -> its _Segment, or None when the group keeps gloo; dropped with the group
_segments: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_setup_lock = threading.Lock()


def configure(enabled: bool) -> None:
    """Whether groups decided after this call may use shared memory (`launch(cpu_shared_memory=)`)."""
    global _enabled
    _enabled = bool(enabled)


def usable(tensor: torch.Tensor, op) -> bool:
    """Whether an all-reduce of `tensor` with `op` can take this transport at all (the same answer on
    every rank of a correct program: it reads only dtype, device, layout and op)."""
    return (_enabled and tensor.device.type == "cpu" and tensor.dtype in _NUMPY_DTYPES and op in _OPS
            and tensor.is_contiguous() and not torch.compiler.is_compiling())


def _host_facts() -> tuple:
    """What must agree across a group's ranks for them to share memory: the same machine (host name
    and boot id) with in-order stores, and a writable shared-memory directory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = None
    return (socket.gethostname(), boot, platform.machine().lower() in _TSO_MACHINES,
            os.access(_SHM_DIR, os.W_OK))


def decide(facts: list[tuple]) -> bool:
    """One decision for a group from every rank's `_host_facts()`: shared memory only when every rank
    is on the same booted machine, with in-order stores and a shared-memory directory."""
    first = facts[0]
    return first[1] is not None and all(f[:2] == first[:2] and f[2] and f[3] for f in facts)


class _Segment:
    """One group's mapped segment: a cache line per rank (flag, byte counts of the two buffers) and
    two buffers of `size` slots of SLOT_BYTES."""

    def __init__(self, path: str, size: int, me: int, create: bool, peers: list[int], timeout_s: float | None):
        self.size, self.me, self.round = size, me, 0
        self.peers, self.timeout_s = peers, timeout_s        # each group rank's pid; the group's timeout
        header = _LINE * size
        total = header + 2 * size * SLOT_BYTES
        if create:
            with open(path, "wb") as f:
                # reserve every page now: a segment larger than what /dev/shm has left (Docker gives 64 MB
                # by default) fails here, and the group keeps gloo, instead of a SIGBUS mid-collective
                os.posix_fallocate(f.fileno(), 0, total)
        self.raw = np.memmap(path, dtype=np.uint8, mode="r+", shape=(total,))
        # per rank: [flag, then for each buffer: chunk bytes, tensor bytes, dtype-and-op code]
        self.lines = self.raw[:header].view(np.int64).reshape(size, _LINE // 8)
        self.data = self.raw[header:].reshape(2, size, SLOT_BYTES)
        self.lock = threading.Lock()

    def all_reduce(self, flat: np.ndarray, ufunc, kind: int) -> None:
        """In-place all-reduce of the 1-D array `flat`, in chunks of at most SLOT_BYTES; `kind` names
        its dtype and reduction (the ranks must agree on it as on the sizes)."""
        step = SLOT_BYTES // flat.itemsize
        # inf and nan are results here as in torch (an fp16 overflow is how the loss scaler learns of it)
        with self.lock, np.errstate(all="ignore"):
            for start in range(0, max(flat.size, 1), step):
                self._round(flat[start:start + step], ufunc, (flat.nbytes, kind))

    def _round(self, chunk: np.ndarray, ufunc, whole: tuple[int, int]) -> None:
        self.round += 1
        k, buf = self.round, self.round % 2
        slots = self.data[buf, :, :chunk.nbytes].view(chunk.dtype)
        np.copyto(slots[self.me], chunk)
        mine = (chunk.nbytes, *whole)
        self.lines[self.me, 1 + 3 * buf:4 + 3 * buf] = mine
        self.lines[self.me, 0] = k                          # publish: after the data (in-order stores)
        self._wait(k)
        theirs = [tuple(row) for row in self.lines[:, 1 + 3 * buf:4 + 3 * buf].tolist()]
        if any(t != mine for t in theirs):
            raise ValueError(f"all_reduce: the ranks passed different tensors or reductions (bytes in this chunk, "
                             f"bytes in all, dtype and op code, by group rank: {theirs}); every rank must all-reduce "
                             "a tensor of the same shape and dtype with the same op")
        ufunc(slots[0], slots[1], out=chunk)        # my own input is safe in my slot
        for r in range(2, self.size):
            ufunc(chunk, slots[r], out=chunk)

    def _wait(self, k: int) -> None:
        flags = self.lines[:, 0]
        spins, start = 0, time.monotonic()
        while flags.min() < k:
            spins += 1
            if spins < 200:             # the peer is usually microseconds away
                continue
            if spins < 2000:
                os.sched_yield()
                continue
            time.sleep(5e-5)            # a slow peer: stop taking its core (more ranks than cores)
            if spins % 2000 == 0:
                self._check_peers(k, start)

    def _check_peers(self, k: int, start: float) -> None:
        late = [r for r in range(self.size) if self.lines[r, 0] < k]
        for r in late:
            try:
                os.kill(self.peers[r], 0)
            except ProcessLookupError:
                raise RuntimeError(f"shared-memory all_reduce: group rank {r} (pid {self.peers[r]}) exited") from None
            except PermissionError:
                pass
        if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
            raise RuntimeError(f"shared-memory all_reduce timed out after {self.timeout_s:.0f} s waiting for group "
                               f"ranks {late}")


def _segment(group) -> _Segment | None:
    """The group's segment, set up on first use with three collectives over the group (every rank
    reaches its first all-reduce on the group together); None when the group keeps gloo."""
    group = group if group is not None else dist.group.WORLD
    if group in _segments:
        return _segments[group]
    with _setup_lock:
        if group in _segments:
            return _segments[group]
        # outside any dispatch mode (the witness, MemTracker): setting up is not the user's traffic
        with _disable_current_modes():
            segment = _set_up(group)
        _segments[group] = segment
        return segment


def _set_up(group) -> _Segment | None:
    size, me = dist.get_world_size(group), dist.get_rank(group)
    facts = [None] * size
    dist.all_gather_object(facts, (_host_facts(), os.getpid(), f"meshboost-{uuid.uuid4().hex}"), group=group)
    if not decide([f[0] for f in facts]):
        return None
    path, pids = os.path.join(_SHM_DIR, facts[0][2]), [f[1] for f in facts]
    try:                                    # the timeout the group's CPU backend was created with
        timeout_s = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        timeout_s = None
    segment, error = None, None
    for creating in (True, False):          # group rank 0 creates, then the others map what it made
        if (me == 0) == creating and error is None:
            try:
                segment = _Segment(path, size, me, creating, pids, timeout_s)
            except OSError as e:            # /dev/shm full or unmappable: the group keeps gloo
                error = f"{type(e).__name__}: {e}"
        if creating:
            dist.barrier(group=group)
    errors = [None] * size
    dist.all_gather_object(errors, error, group=group)
    if me == 0 and os.path.exists(path):
        os.unlink(path)                     # the mappings live on; nothing is left behind if a rank dies
    return None if any(e is not None for e in errors) else segment


def all_reduce(tensor: torch.Tensor, group, op) -> bool:
    """All-reduce `tensor` in place over `group` through shared memory when the group can; False
    (nothing done) when it keeps gloo. Call only where `usable(tensor, op)`."""
    segment = _segment(group)
    if segment is None:
        return False
    from meshboost.distributed.profiling import witness_transport
    witness_transport("all_reduce", group, tensor.numel() * tensor.element_size())
    kind = 16 * list(_NUMPY_DTYPES).index(tensor.dtype) + list(_OPS).index(op)
    segment.all_reduce(tensor.detach().view(-1).numpy(), _OPS[op], kind)
    return True
