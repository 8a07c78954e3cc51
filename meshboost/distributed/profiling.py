"""Communication accounting, per process group and per rank.

Owns: the `comm_counter()` context manager and `record_collective`, which every collective in
meshboost calls (`distributed/comm.py`, `distributed/p2p.py`, the DDP comm hook);
`wait_timer()` with `record_wait`, the time the caller spends blocked in collectives and the time
asynchronous ones stay in flight behind its compute (exposed and hidden communication);
`dispatched_comm_counter()`, an independent witness that sees every collective passing through
torch's dispatcher (torch.distributed calls, DDP's reducer and buffer broadcasts, DTensor and
functional collectives), so meshboost's own accounting can be checked and peers can be measured in
the same units; `wire_bytes()` (what the OS saw this process write). Memory accounting lives in
`meshboost.optim.memory.memory_breakdown`.
Must not issue any communication itself. "Bytes sent" uses the bandwidth-optimal ring cost per
rank: all-reduce 2(P-1)/P * n, all-gather and reduce-scatter (P-1)/P * n (n = bytes of the full
tensor), broadcast n from the root's view, send n.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

_active: list["CommCounter"] = []
_wait_timers: list["WaitTimer"] = []


@dataclass
class GroupStats:
    calls: int = 0
    payload_bytes: int = 0          # bytes of the full (logical) tensor each collective works on
    sent_bytes: float = 0.0         # ring-algorithm bytes this rank sends
    by_op: dict = field(default_factory=lambda: defaultdict(int))           # op -> calls
    bytes_by_op: dict = field(default_factory=lambda: defaultdict(int))     # op -> payload bytes


class CommCounter:
    """Per-group statistics collected while active. Groups are named by `names` (group -> label);
    unnamed groups are labelled by their ranks."""

    def __init__(self, names: dict | None = None):
        self._names = {id(g): n for g, n in (names or {}).items() if g is not None}
        self.groups: dict[str, GroupStats] = defaultdict(GroupStats)

    def label(self, group) -> str:
        if group is None or group is dist.group.WORLD:
            return self._names.get(id(group), "world")
        if id(group) in self._names:
            return self._names[id(group)]
        return "ranks" + str(dist.get_process_group_ranks(group))

    def add(self, op: str, group, nbytes: int) -> None:
        size = dist.get_world_size(group)
        factor = {"all_reduce": 2 * (size - 1) / size, "all_gather": (size - 1) / size,
                  "reduce_scatter": (size - 1) / size, "all_to_all": (size - 1) / size}.get(op, 1.0)
        stats = self.groups[self.label(group)]
        stats.calls += 1
        stats.payload_bytes += nbytes
        stats.sent_bytes += factor * nbytes
        stats.by_op[op] += 1
        stats.bytes_by_op[op] += nbytes

    def summary(self) -> dict:
        return {k: {"calls": v.calls, "payload_bytes": v.payload_bytes, "sent_bytes": v.sent_bytes,
                    "by_op": dict(v.by_op), "bytes_by_op": dict(v.bytes_by_op)}
                for k, v in sorted(self.groups.items())}


def record_collective(op: str, group, tensor_or_bytes) -> None:
    """Tell every active counter that `op` ran on `group` over a full tensor of this size."""
    if not _active:
        return
    nbytes = (tensor_or_bytes.numel() * tensor_or_bytes.element_size()
              if isinstance(tensor_or_bytes, torch.Tensor) else int(tensor_or_bytes))
    for counter in _active:
        counter.add(op, group, nbytes)


def _mesh_labels(mesh, names: dict | None) -> dict:
    labels = dict(names or {})
    if mesh is not None:
        # Later axes win when groups coincide (size-1 axes share no real traffic anyway). An axis that
        # spans the whole world is torch's default group itself, so world-group collectives (grad
        # norm, overflow flag) are labelled with that axis: count phases separately to tell them apart.
        for axis in ("dp", "pp", "tp") + (("edp", "ep") if getattr(mesh, "ep_size", 1) > 1 else ()) \
                + (("cp",) if getattr(mesh, "cp_size", 1) > 1 else ()):
            labels[mesh.group(axis)] = axis
    return labels


@contextlib.contextmanager
def comm_counter(mesh=None, names: dict | None = None):
    """Count collectives inside the block. With a `ParallelMesh`, groups are labelled tp/pp/dp.

    >>> with comm_counter(mesh) as c:
    ...     train_step()
    >>> c.summary()["tp"]["calls"]
    """
    counter = CommCounter(_mesh_labels(mesh, names))
    _active.append(counter)
    try:
        yield counter
    finally:
        _active.remove(counter)


@dataclass
class WaitTimer:
    """Seconds spent in collectives while active. blocked_s: the caller waited (a synchronous
    collective, or `wait()` on an asynchronous one): exposed communication. overlapped_s: asynchronous
    collectives in flight between their start and the `wait()` call, while the caller computed: the
    window in which communication can hide (it hid entirely when the matching wait blocked ~0)."""

    blocked_s: float = 0.0
    overlapped_s: float = 0.0


def timing_waits() -> bool:
    """True while a `wait_timer()` is active (callers skip reading the clock otherwise)."""
    return bool(_wait_timers)


def record_wait(blocked_s: float, overlapped_s: float = 0.0) -> None:
    """Tell every active timer that a collective blocked the caller `blocked_s` seconds after being
    in flight `overlapped_s` seconds behind other work."""
    for timer in _wait_timers:
        timer.blocked_s += blocked_s
        timer.overlapped_s += overlapped_s


@contextlib.contextmanager
def wait_timer():
    """Time meshboost's collectives inside the block (exposed vs overlapped; see `WaitTimer`)."""
    timer = WaitTimer()
    _wait_timers.append(timer)
    try:
        yield timer
    finally:
        _wait_timers.remove(timer)


# -- an independent witness: every collective that passes through torch's dispatcher ------------
def _c10d_group(arg):
    """The ProcessGroup named by a dispatcher argument (a boxed group or a group name), or None."""
    if isinstance(arg, dist.ProcessGroup):
        return arg
    if isinstance(arg, torch.ScriptObject):
        try:
            return dist.ProcessGroup.unbox(arg)
        except (RuntimeError, TypeError):
            return None
    if isinstance(arg, str):
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group
            return _resolve_process_group(arg)
        except (RuntimeError, ValueError, KeyError):
            return None
    return None


def _nbytes(tensors) -> int:
    if torch.is_tensor(tensors):
        if hasattr(tensors, "_local_tensor"):          # a DTensor reaching a raw collective
            tensors = tensors._local_tensor
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_nbytes(t) for t in tensors)
    return 0


# dispatcher op name -> (counted op, index of the argument whose bytes are the full tensor).
# For the gathers the full tensor is the output (argument 0); for everything else the input.
_DISPATCHED = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_coalesced": ("all_reduce", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
    "_allgather_base_": ("all_gather", 0), "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0), "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1), "all_to_all_single": ("all_to_all", 0),
    "send": ("send", 0), "reduce_": ("reduce", 0), "gather_": ("gather", 1),   # recv sends nothing
    "scatter_": ("scatter", 0),
}
# functional all-gathers take the local input and the group size: full = input * group size.
_FUNCTIONAL_GATHERS = ("all_gather_into_tensor", "all_gather_into_tensor_coalesced")


def _dispatch_mode_class():
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class _CollectiveWitness(TorchDispatchMode):
        def __init__(self, counter: "CommCounter"):
            super().__init__()
            self.counter = counter

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.OpOverload) and func.namespace in (
                    "c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"):
                self._record(func, args)
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented        # let DTensor desugar into collectives first, then see those
            return func(*args, **kwargs)

        def _record(self, func, args) -> None:
            name = func._schema.name.split("::")[-1]
            values = list(args)
            group = next((g for g in (_c10d_group(a) for a in values if not torch.is_tensor(a)) if g is not None),
                         None)
            if group is None or dist.get_world_size(group) == 1:
                return
            if name in _FUNCTIONAL_GATHERS:
                self.counter.add("all_gather", group, _nbytes(values[0]) * dist.get_world_size(group))
            elif name in _DISPATCHED:
                op, index = _DISPATCHED[name]
                self.counter.add(op, group, _nbytes(values[index]))

    return _CollectiveWitness


@contextlib.contextmanager
def dispatched_comm_counter(mesh=None, names: dict | None = None):
    """Count every collective that reaches torch's dispatcher inside the block (torch.distributed
    calls, DDP's gradient buckets and buffer broadcasts, DTensor redistributions, functional
    collectives), in the same units as `comm_counter`. A witness, not the contract: meshboost code
    still calls `record_collective`; the two must agree, and a difference names a collective that
    bypasses the accounting. Slower than `comm_counter` (a Python hook on every op): count in a
    step you do not time.
    """
    counter = CommCounter(_mesh_labels(mesh, names))
    with _dispatch_mode_class()(counter):
        yield counter


def wire_bytes() -> int | None:
    """Bytes this process has handed to write()/writev() so far (Linux /proc/self/io `wchar`), or
    None where unavailable. Around a step that prints nothing, the difference is what the
    collectives really put on the sockets (gloo): a third opinion, headers included."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None
