"""Weight export: a model's full, unsharded HF tensors at any layout, streamed bucket by bucket to an inference
engine's `load_weights(iterable)` (vLLM's, SGLang's) or into a plain HF model (`load_into`).

Owns the protocol. Every rank of the mesh calls `export_weights` and iterates it (a consumer that stops early,
with `break` or `close()`, makes rank 0 receive the rest unseen, so no rank hangs; a delta export then forgets
what it sent); global rank 0 alone receives the (hf_name, tensor) pairs (each stage's, in stage order), every other rank yields nothing.
  1. Arrival: each rank checks in at the process group's store and waits at most `timeout` seconds for the
     others; then every rank that called raises, naming the ranks that did not (one arriving later raises
     the same), so an export run on rank 0 only fails clearly instead of hanging in a gather.
  2. Plan: one all_gather_object of every rank's entries (names, shapes, dtypes: its stage's). Every rank
     holds the same global list, stage 0's entries first, and cuts it into the same buckets (consecutive
     entries of one stage, at most `bucket_bytes` exported bytes each). A bucket smaller than the largest
     tensor is refused here, on every rank, before any gather.
  3. Delta (`ExportState`): each rank compares its local pieces of every entry with its copy from the last
     complete export (`torch.equal`: exact, no hash); one MAX all-reduce of the flags, so every rank drops
     the same unchanged entries. The copies are each rank's own shards: one more copy of its local weights.
  4. Buckets: the ranks of the owning stage gather each entry with `model_io.gather_entry`, the one gather
     `save_model` uses (ZeRO masters to dp rank 0, FSDP2's all-gather, tp and ep gathers on replica 0); the
     stage's lead (dp 0, tp 0, cp 0) casts them, packs them into one flat buffer and sends it to rank 0
     (stage 0's lead is rank 0 itself), which yields views of that buffer.
Memory beyond the model's: on a stage lead and rank 0 one bucket plus the entry being gathered; on the other
gathering ranks the entry being gathered; nothing grows with the model. Values: `save_model`'s (the fp32
master where the optimizer keeps one), cast to `dtype` (default: the dtype each live tensor holds). What is
exported (names, LoRA merged or as adapters) is `export_entries.py`'s. Must not write files.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.checkpoint.export_entries import ExportEntry, local_piece
from meshboost.checkpoint.model_io import gather_entry
from meshboost.checkpoint.writer import SaveRoles, save_roles
from meshboost.distributed import comm
from meshboost.distributed.launch import group_timeout

_ALIGN = 16             # each tensor of a bucket buffer starts at a multiple of this (any dtype can view it)
_STORE_PREFIX = "meshboost/export_weights"


@dataclass
class ExportState:
    """What delta mode compares with: this rank's local pieces of each entry at the last complete export
    (clones, on the device the weights live on). An export that does not finish forgets them all, so the
    next one sends everything."""

    previous: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    settings: tuple = ()         # what was exported (dtype, names): another request starts afresh


@dataclass
class _Planned:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    stage: int
    nbytes: int


def _check_arguments(bucket_bytes, dtype, timeout) -> None:
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes={bucket_bytes!r} must be a positive number of bytes, e.g. 256 << 20")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r} must be a floating-point torch.dtype (torch.bfloat16, ...) or None "
                        "for the dtype the model's weights hold")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")


def export_weights(model: nn.Module, entries: list[ExportEntry], mesh=None, bucket_bytes: int = 256 << 20,
                   dtype: torch.dtype | None = None, master_weight: Callable | None = None,
                   state: ExportState | None = None, timeout: float | None = None
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for `entries` (`export_entries.entries_of(model, ...)`) of `model` at its
    layout over `mesh`, on global rank 0; see the module docstring for the protocol. master_weight: as in
    `save_model`. state: delta mode (only entries whose local pieces changed since the export that last
    filled `state`; None: everything). Yielded tensors live on rank 0's device, views of the bucket's
    buffer or of the live weights: read them (copy them into the engine), never write them. Call on every
    rank and iterate to the end."""
    _check_arguments(bucket_bytes, dtype, timeout)
    roles = save_roles(mesh)
    _arrive(roles, timeout)
    plan, leads = _plan(entries, roles, dtype)
    largest = max(plan, key=lambda p: p.nbytes, default=None)
    if largest is not None and largest.nbytes > bucket_bytes:
        raise ValueError(f"export_weights(bucket_bytes={bucket_bytes}): {largest.name} takes {largest.nbytes} bytes "
                         f"in {largest.dtype} ({list(largest.shape)}); pass bucket_bytes >= {largest.nbytes} (a "
                         "bucket holds whole tensors)")
    mine = {e.name: e for e in entries}
    if state is not None and state.settings != (dtype, tuple(mine)):
        state.previous.clear()
        state.settings = (dtype, tuple(mine))
    try:
        if state is not None:
            plan = _changed(plan, mine, roles, state)
        stream = (pair for bucket in _buckets(plan, bucket_bytes)
                  for pair in _send_bucket(bucket, mine, roles, leads, dtype, master_weight))
        for pair in stream:
            try:
                yield pair
            except GeneratorExit:
                # the consumer stopped early (a `break`, or the iterator closed or collected): the other ranks
                # are still gathering and sending the remaining buckets, so this rank joins them to the end
                # without yielding (no rank hangs); the delta state is dropped below, the next export sends all
                for _ in stream:
                    pass
                raise
    except BaseException:
        if state is not None:
            state.previous.clear()              # the consumer may have missed some: the next export sends all
        raise


def _arrive(roles: SaveRoles, timeout: float | None) -> None:
    """Every rank checks in at the default store (a ticket: its arrival's number); the ranks of one export
    wait for the others' tickets of the same export, at most `timeout` seconds, and one decision (ok or
    failed) is taken once, by compare-and-set, so every rank that arrives, in time or late, learns it."""
    if roles.group is None or dist.get_world_size(roles.group) == 1:
        return
    store = dist.distributed_c10d._get_default_store()      # the launch's own store: no collective needed
    world, rank = dist.get_world_size(roles.group), dist.get_rank(roles.group)
    ticket = store.add(f"{_STORE_PREFIX}/tickets", 1)
    call = (ticket - 1) // world
    key = f"{_STORE_PREFIX}/{call}"
    store.set(f"{key}/rank{rank}", "1")
    limit = timeout if timeout is not None else (t.total_seconds() if (t := group_timeout(roles.group)) else 600.0)
    deadline, pause = time.monotonic() + limit, 0.001
    while True:
        if store.add(f"{_STORE_PREFIX}/tickets", 0) >= (call + 1) * world:
            decision = store.compare_set(f"{key}/decision", "", "ok")
        elif time.monotonic() > deadline:       # the ranks missing now are the ones every rank names
            missing = [r for r in range(world) if not store.check([f"{key}/rank{r}"])]
            decision = store.compare_set(f"{key}/decision", "", " ".join(["failed", *map(str, missing)]))
        elif store.check([f"{key}/decision"]):
            decision = store.get(f"{key}/decision")
        else:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            continue
        break
    decision = decision.decode() if isinstance(decision, bytes) else decision
    if decision == "ok":
        return
    missing = [int(r) for r in decision.split()[1:]]
    raise RuntimeError(f"export_weights (export #{call}) was called on ranks "
                       f"{[r for r in range(world) if r not in missing]} only: ranks {missing} did not call it within "
                       f"{limit:g} s. Call booster.export_weights on every rank and iterate it to the end (only "
                       "global rank 0 receives the tensors; the other ranks yield nothing)")


def _plan(entries: list[ExportEntry], roles: SaveRoles, dtype) -> tuple[list[_Planned], dict[int, int]]:
    """The global list (the same on every rank) and each stage's lead rank in `roles.group`."""
    own = [(e.name, tuple(e.shape), str(e.out_dtype(dtype)).split(".")[1]) for e in entries]
    rank = dist.get_rank(roles.group) if roles.group is not None else 0
    report = (roles.stage, roles.stage_writer, rank, own)
    reports = [None] * (dist.get_world_size(roles.group) if roles.group is not None else 1)
    if roles.group is not None:
        dist.all_gather_object(reports, report, group=roles.group)
    else:
        reports = [report]
    leads = {stage: r for stage, lead, r, _ in reports if lead}
    listed = {stage: names for stage, lead, _, names in reports if lead}
    plan, seen = [], set()
    for stage in sorted(listed):
        for name, shape, dt in listed[stage]:
            if name in seen:                    # a name two stages hold (a tied copy): the first stage's
                continue
            seen.add(name)
            dt = getattr(torch, dt)
            plan.append(_Planned(name, shape, dt, stage, _numel(shape) * dt.itemsize))
    return plan, leads


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _changed(plan: list[_Planned], mine: dict[str, ExportEntry], roles: SaveRoles, state: ExportState
             ) -> list[_Planned]:
    """The entries of `plan` whose local pieces changed on any rank since `state` was filled; `state` then
    holds the current pieces (one MAX all-reduce of one flag per entry)."""
    flags = torch.zeros(len(plan), dtype=torch.int32, device=roles.device)
    for i, p in enumerate(plan):
        entry = mine.get(p.name)
        if entry is None or roles.stage != p.stage:
            continue
        now = [local_piece(t) for t in entry.sources]
        before = state.previous.get(p.name)
        if before is None or len(before) != len(now) or not all(
                b.shape == n.shape and b.dtype == n.dtype and torch.equal(b, n) for b, n in zip(before, now)):
            flags[i] = 1
            state.previous[p.name] = [n.clone() for n in now]
    if roles.group is not None:
        comm.all_reduce(flags, roles.group, op=dist.ReduceOp.MAX)
    return [p for p, f in zip(plan, flags.tolist()) if f]


def _buckets(plan: list[_Planned], bucket_bytes: int) -> Iterator[list[_Planned]]:
    """Consecutive entries of one stage, at most `bucket_bytes` each (every entry fits: checked)."""
    bucket, size = [], 0
    for p in plan:
        if bucket and (bucket[0].stage != p.stage or size + p.nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += p.nbytes
    if bucket:
        yield bucket


def _offsets(bucket: list[_Planned]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for p in bucket:
        offsets.append(end)
        end += -(-p.nbytes // _ALIGN) * _ALIGN
    return offsets, end


def _send_bucket(bucket: list[_Planned], mine: dict[str, ExportEntry], roles: SaveRoles, leads: dict[int, int],
                 dtype, master_weight) -> Iterator[tuple[str, torch.Tensor]]:
    """One bucket: its stage gathers and its lead packs and sends; global rank 0 receives and yields."""
    stage = bucket[0].stage
    rank = dist.get_rank(roles.group) if roles.group is not None else 0
    lead = leads[stage]
    offsets, total = _offsets(bucket)
    buffer = None
    if roles.stage == stage:
        values = []
        if roles.stage_writer and rank != 0:
            buffer = torch.empty(total, dtype=torch.uint8, device=roles.device)
        for p, offset in zip(bucket, offsets):
            entry = mine[p.name]
            fulls = [gather_entry(t, roles, master_weight, on_cpu=False) for t in entry.sources]
            if not roles.stage_writer:
                continue                          # a gather peer: its copy goes at once
            value = entry.value(fulls, dtype)
            if tuple(value.shape) != tuple(p.shape) or value.dtype != p.dtype:
                raise RuntimeError(f"export_weights: {p.name} gathered as {list(value.shape)} {value.dtype}, planned "
                                   f"as {list(p.shape)} {p.dtype} (a parameter record that disagrees with the tensor)")
            if buffer is None:
                values.append((p.name, value))
            else:
                buffer[offset:offset + p.nbytes].copy_(value.contiguous().view(-1).view(torch.uint8))
            del fulls, value
        if buffer is not None:
            dist.send(buffer, group_dst=0, group=roles.group)
            return
        if rank == 0:
            yield from values
        return
    if rank != 0:
        return
    buffer = torch.empty(total, dtype=torch.uint8, device=roles.device)
    dist.recv(buffer, group_src=lead, group=roles.group)
    for p, offset in zip(bucket, offsets):
        yield p.name, buffer[offset:offset + p.nbytes].view(p.dtype).view(p.shape)


def load_into(model: nn.Module, pairs, strict: bool = False) -> list[str]:
    """The consumer side, as an inference engine's `load_weights(iterable)`: copy each (hf_name, tensor) of
    `pairs` into plain HF `model`'s tensor of that name (a tied name reaches the tensor it shares), on the
    model's device and dtype. Returns the names loaded, in order; unknown names and wrong shapes raise.
    strict: every tensor of the model's state dict must have come (a full export, not a delta)."""
    targets = model.state_dict(keep_vars=True)
    loaded = []
    with torch.no_grad():
        for name, tensor in pairs:
            if name not in targets:
                raise KeyError(f"load_into: {name!r} is no tensor of {type(model).__name__} (an export of another "
                               "model, or of a LoRA model as adapters: load those with peft)")
            target = targets[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"load_into: {name} is {list(tensor.shape)}, {type(model).__name__} holds "
                                 f"{list(target.shape)}")
            target.copy_(tensor)
            loaded.append(name)
    if strict:
        have = {id(targets[n]) for n in loaded}
        missing = [n for n, t in targets.items() if id(t) not in have]
        if missing:
            raise ValueError(f"load_into(strict=True): {len(missing)} tensors did not come, e.g. {missing[:3]}")
    return loaded
