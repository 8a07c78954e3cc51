"""Shared-memory collectives for CPU process groups whose ranks share one host: all-reduce, all-gather
and sum-reduce-scatter.

Owns: deciding, once per group, whether its CPU collectives can go through shared memory instead of
gloo's loopback sockets, the segment that group maps, and the exchange itself. On this repository's
2-core test machine a 1 MB gloo all-reduce between two processes takes 2.0-3.4 ms of wall time and
1.1-1.9 ms of CPU (threads waking threads, socket copies), and a tensor-parallel step makes 20 of
them; through shared memory it is two memory copies and a flag. Must not change a number: every rank
reduces the same slots in the same (rank) order, so all ranks get bitwise the same result, and at two
ranks the result is gloo's (a + b == b + a); a gather copies bytes. Must not change what is counted:
`comm.py` records the collective before choosing the transport, and the witness
(`profiling.dispatched_comm_counter`) hears this transport as it hears torch's dispatcher.

The exchange, for round k of a group (every rank counts the same rounds):
  1. fill my slot of buffer k % 2 (a chunk of my tensor; for a reduce-scatter a column of every rank's
     part), write its size, the whole tensor's size and a code for the collective, dtype and reduction
     beside my flag, set my flag to k;
  2. wait until every flag is >= k (a peer may already be at k + 1: it writes the other buffer);
  3. check every rank wrote what I wrote (a mismatch is a user error, refused on every rank in the same
     round, never summed), then reduce the parts in rank order (mine from my own tensor, still in this
     core's cache) into my tensor or the caller's output (or copy the slots, gathering).
Two buffers suffice: a peer can write buffer k % 2 again only in round k + 2, which needs my flag
k + 1, which I set after I have read round k. The flag is written after the data by a separate
store, and x86-64 keeps stores (and loads) in order, so a flag seen means its data is there; other
architectures (weaker ordering) keep gloo.

No thread runs behind the caller (on two cores there is no idle one to run it). An asynchronous
all-reduce or reduce-scatter that fits one round is split instead: step 1 runs at issue and steps 2-3
at its `wait()`, so the caller's independent work (the weight-gradient products of Megatron's
backward overlap) runs while the peers catch up, instead of this rank waiting for the slowest at the
collective. A round is read before the next one is published (the two-buffer rule above), so a later
collective on the group first finishes a round nobody waited for. Larger tensors, all-gathers and
synchronous calls are done when they return. Not under torch.compile (dynamo traces the collective
itself), not for reductions of dtypes numpy cannot add (bfloat16) nor other than sum, max, min and
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
KIND_REDUCE, KIND_GATHER, KIND_SCATTER = 10_000, 20_000, 30_000     # in a round's header: which collective

_enabled = True
# group -> its _Segment, or None when the group keeps gloo; dropped with the group
_segments: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_setup_lock = threading.Lock()


def configure(enabled: bool) -> bool:
    """Whether CPU collectives may use shared memory from now on (`launch(cpu_shared_memory=)`); returns
    the previous setting, for a caller that switches it for a while to put back."""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


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


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def decide(facts: list[tuple]) -> bool:
    """One decision for a group from every rank's `_host_facts()`: shared memory only when every rank
    is on the same booted machine, with in-order stores and a shared-memory directory."""
    first = facts[0]
    return first[1] is not None and all(f[:2] == first[:2] and f[2] and f[3] for f in facts)


class _Posted:
    """A round this rank published and has not read: `wait()` reads it (reduces into the caller's tensor)
    unless a later collective on the group already did. The work handle of an asynchronous call."""

    def __init__(self, segment: "_Segment", finish):
        self.segment, self.finish = segment, finish

    def wait(self) -> None:
        with self.segment.lock, np.errstate(all="ignore"):
            if self.segment.posted is self:
                self.segment.settle()


class _Segment:
    """One group's mapped segment: a cache line per rank (its flag and, per buffer, the round's header:
    chunk bytes, tensor bytes, collective/dtype/op code) and two buffers of `size` slots of SLOT_BYTES."""

    def __init__(self, path: str, size: int, me: int, create: bool, peers: list[int | None], timeout_s: float | None):
        self.size, self.me, self.round = size, me, 0
        self.peers, self.timeout_s = peers, timeout_s        # each rank's pid (None: not visible here); the timeout
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
        self.posted: _Posted | None = None      # a round this rank published and has not read yet

    def all_reduce(self, flat: np.ndarray, ufunc, kind: int, later: bool = False,
                   out: np.ndarray | None = None) -> _Posted | None:
        """All-reduce of the 1-D array `flat` into `out` (default: in place), in chunks of at most SLOT_BYTES;
        `kind` names the collective, dtype and reduction (the ranks must agree on it as on the sizes).
        `later` and one chunk: published only, returns the round, read (and reduced) at its `wait()`."""
        in_place, out = out is None, flat if out is None else out
        step = SLOT_BYTES // flat.itemsize

        def combine(slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
            # rank order, my own part read from `src` (the bytes of my slot, still in this core's cache)
            # unless an in-place reduction has overwritten it by then (from the third rank on)
            slots = slots.view(src.dtype)
            parts = [src if r == self.me and (self.me < 2 or not in_place) else slots[r] for r in range(self.size)]
            ufunc(parts[0], parts[1], out=dst)
            for part in parts[2:]:
                ufunc(dst, part, out=dst)

        def fill(chunk: np.ndarray):
            return lambda mine: np.copyto(mine.view(chunk.dtype), chunk)

        if later and flat.size <= step:
            posted = self._publish(flat.nbytes, (flat.nbytes, kind), fill(flat))
            return self._defer(lambda: combine(self._read(*posted), flat, out))
        for start in range(0, max(flat.size, 1), step):
            chunk = flat[start:start + step]
            combine(self._exchange(chunk.nbytes, (flat.nbytes, kind), fill(chunk)), chunk, out[start:start + step])
        return None

    def all_gather(self, out: np.ndarray, shard: np.ndarray) -> None:
        """Every rank's 1-D byte array `shard` into the byte array `out` of `size` times its length, in
        rank order (`shard` may be this rank's part of `out`)."""
        width = shard.nbytes
        rows = out.reshape(self.size, width)
        for start in range(0, max(width, 1), SLOT_BYTES):
            piece = shard[start:start + SLOT_BYTES]
            slots = self._exchange(piece.nbytes, (width, KIND_GATHER), lambda mine: np.copyto(mine, piece))
            np.copyto(rows[:, start:start + piece.nbytes], slots)

    def reduce_scatter(self, out: np.ndarray, flat: np.ndarray, ufunc, kind: int, later: bool = False) -> _Posted | None:
        """This rank's part of the rank-order reduction of every rank's 1-D `flat` (`size` parts of
        `out`'s length) into `out`: each round carries a column of every part. `later` and one round:
        as `all_reduce`'s."""
        width = out.size
        parts = flat.reshape(self.size, width)
        step = max(SLOT_BYTES // (self.size * flat.itemsize), 1)

        def combine(slots: np.ndarray, n: int, target: np.ndarray) -> None:
            mine = [slots[r].view(flat.dtype).reshape(self.size, n)[self.me] for r in range(self.size)]
            ufunc(mine[0], mine[1], out=target)
            for r in range(2, self.size):
                ufunc(target, mine[r], out=target)

        def fill(cols: np.ndarray):
            return lambda mine: np.copyto(mine.view(flat.dtype).reshape(self.size, cols.shape[1]), cols)

        if later and width <= step:
            posted = self._publish(parts.nbytes, (flat.nbytes, kind), fill(parts))
            return self._defer(lambda: combine(self._read(*posted), width, out))
        for start in range(0, max(width, 1), step):
            cols = parts[:, start:start + step]
            combine(self._exchange(cols.nbytes, (flat.nbytes, kind), fill(cols)), cols.shape[1],
                    out[start:start + cols.shape[1]])
        return None

    def _exchange(self, nbytes: int, whole: tuple[int, int], fill) -> np.ndarray:
        """One round: `fill` my slot's first `nbytes` bytes, publish, wait for every rank, check they all
        wrote what I wrote (`nbytes` and `whole`: the whole tensor's bytes and the kind); returns the
        round's slots, [size, nbytes] bytes, readable until my next round."""
        return self._read(*self._publish(nbytes, whole, fill))

    def _publish(self, nbytes: int, whole: tuple[int, int], fill) -> tuple:
        """Step 1 of a round (after reading the round still unread: the two-buffer rule); returns what
        `_read` needs."""
        self.settle()
        self.round += 1
        k, buf = self.round, self.round % 2
        slots = self.data[buf, :, :nbytes]
        fill(slots[self.me])
        mine = (nbytes, *whole)
        self.lines[self.me, 1 + 3 * buf:4 + 3 * buf] = mine
        self.lines[self.me, 0] = k                          # publish: after the data (in-order stores)
        return k, buf, slots, mine

    def _defer(self, finish) -> _Posted:
        self.posted = _Posted(self, finish)
        return self.posted

    def settle(self) -> None:
        """Read the round this rank published and has not read yet, if any (caller holds the lock)."""
        posted, self.posted = self.posted, None
        if posted is not None:
            posted.finish()

    def _read(self, k: int, buf: int, slots: np.ndarray, mine: tuple) -> np.ndarray:
        """Steps 2 and 3 of round `k`: wait for every rank, check they wrote what I wrote."""
        self._wait(k)
        theirs = [tuple(row) for row in self.lines[:, 1 + 3 * buf:4 + 3 * buf].tolist()]
        if any(t != mine for t in theirs):
            raise ValueError(f"shared-memory collective: the ranks passed different tensors or collectives (bytes in "
                             f"this round, bytes in all, collective/dtype/op code, by group rank: {theirs}); every "
                             "rank must call the same collective on a tensor of the same shape and dtype")
        return slots

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
        for r in (r for r in late if self.peers[r] is not None):
            try:
                os.kill(self.peers[r], 0)
            except ProcessLookupError:
                raise RuntimeError(f"shared-memory collective: group rank {r} (pid {self.peers[r]}) exited") from None
            except PermissionError:
                pass
        if self.timeout_s is not None and time.monotonic() - start > self.timeout_s:
            raise RuntimeError(f"shared-memory collective timed out after {self.timeout_s:.0f} s waiting for group "
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
    if "gloo" not in str(dist.get_backend(group)):     # MPI, torch's fake group, a backend of the user's: theirs
        return None
    size, me = dist.get_world_size(group), dist.get_rank(group)
    facts = [None] * size
    dist.all_gather_object(facts, (_host_facts(), (_pid_namespace(), os.getpid()), f"meshboost-{uuid.uuid4().hex}"),
                           group=group)
    if not decide([f[0] for f in facts]):
        return None
    path = os.path.join(_SHM_DIR, facts[0][2])
    # a peer's pid can be checked only from its own pid namespace (containers sharing /dev/shm may not share it)
    pids = [pid if namespace == _pid_namespace() else None for namespace, pid in (f[1] for f in facts)]
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


def _run(group, op_name: str, nbytes: int, work) -> tuple[bool, _Posted | None]:
    """(False, None) when the group keeps gloo; else (True, the round still to read or None when done)."""
    segment = _segment(group)
    if segment is None:
        return False, None
    from meshboost.distributed.profiling import witness_transport
    witness_transport(op_name, group, nbytes)
    # inf and nan are results here as in torch (an fp16 overflow is how the loss scaler learns of it)
    with segment.lock, np.errstate(all="ignore"):
        return True, work(segment)


def _kind(collective: int, dtype: torch.dtype, op=dist.ReduceOp.SUM) -> int:
    return collective + 100 * list(_NUMPY_DTYPES).index(dtype) + list(_OPS).index(op)


def all_reduce(tensor: torch.Tensor, group, op, later: bool = False,
               out: torch.Tensor | None = None) -> tuple[bool, _Posted | None]:
    """All-reduce `tensor` over `group`, in place or into `out` (contiguous, its shape and dtype; `tensor`
    then unchanged), through shared memory when it can: (False, None) when it keeps the backend (nothing
    done), (True, None) when done, (True, a round) when `later` and published only: the round's `wait()`
    finishes it, and `tensor` must not be touched until then."""
    if not usable(tensor, op) or (out is not None and not (out.is_contiguous() and out.dtype == tensor.dtype
                                                           and out.device == tensor.device
                                                           and out.numel() == tensor.numel())):
        return False, None
    flat = tensor.detach().view(-1).numpy()
    dst = None if out is None else out.detach().view(-1).numpy()
    return _run(group, "all_reduce", flat.nbytes,
                lambda seg: seg.all_reduce(flat, _OPS[op], _kind(KIND_REDUCE, tensor.dtype, op), later, dst))


def gather_usable(out: torch.Tensor, shard: torch.Tensor, size: int) -> bool:
    """Whether an all-gather of `shard` into `out` can take this transport (any dtype: bytes are copied)."""
    return (_enabled and out.device.type == "cpu" and shard.device.type == "cpu" and out.dtype == shard.dtype
            and out.is_contiguous() and shard.is_contiguous() and out.numel() == size * shard.numel()
            and not torch.compiler.is_compiling())


def all_gather(out: torch.Tensor, shard: torch.Tensor, group) -> bool:
    """Every rank's `shard` into `out` (rank order, flat) through shared memory when it can; False
    (nothing done) when the transfer keeps the backend."""
    if not gather_usable(out, shard, dist.get_world_size(group)):
        return False
    out_bytes, shard_bytes = (t.detach().reshape(-1).view(torch.uint8).numpy() for t in (out, shard))
    return _run(group, "all_gather", out_bytes.nbytes, lambda seg: seg.all_gather(out_bytes, shard_bytes))[0]


def scatter_usable(out: torch.Tensor, tensor: torch.Tensor, size: int) -> bool:
    """Whether a sum-reduce-scatter of `tensor` into `out` can take this transport."""
    return (usable(tensor, dist.ReduceOp.SUM) and out.device.type == "cpu" and out.dtype == tensor.dtype
            and out.is_contiguous() and tensor.numel() == size * out.numel())


def reduce_scatter(out: torch.Tensor, tensor: torch.Tensor, group, later: bool = False) -> tuple[bool, _Posted | None]:
    """This rank's part of the sum over ranks of `tensor` (flat, `size` parts) into `out`, returning as
    `all_reduce`."""
    if not scatter_usable(out, tensor, dist.get_world_size(group)):
        return False, None
    out_flat, flat = out.detach().view(-1).numpy(), tensor.detach().reshape(-1).numpy()
    return _run(group, "reduce_scatter", flat.nbytes,
                lambda seg: seg.reduce_scatter(out_flat, flat, np.add, _kind(KIND_SCATTER, tensor.dtype), later))
