"""ZeroBucket: one flat run of parameters that ZeRO partitions over the data-parallel group.

Owns which elements of a parameter a dp rank owns (`ZeroBucket.piece`, the one routine that building
masters, refreshing them, exporting and importing state all read), the per-parameter gather of
partitioned tensors, which parameters may share a bucket, and the flat buffer that lets the master
shard be the weights themselves: when masters and weights have one dtype and one device (fp32
training, or master_weights=False) the bucket's parameters are laid out as views of one flat buffer
(`bind_views`) and the master is this rank's slice of it, so the inner optimizer steps the weights in
place and the all-gather after the step writes the other ranks' slices straight into the buffer.
Must not decide the step order or reduce gradients (zero.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.distributed import comm
from meshboost.distributed.param_info import (
    DENSE,
    EXPERT,
    get_tp_info,
    grad_reduction,
    is_pipeline_replica,
    is_tp_sharded,
)

_KINDS = [(sharded, tied, first, reduced) for reduced in (DENSE, EXPERT) for sharded in (True, False)
          for tied in (False, True) for first in (True, False)]


def bucket_kind(p: torch.Tensor) -> tuple[bool, bool, bool, str]:
    """What decides who counts a gradient in the norm and which group reduces it: a bucket holds one
    kind only."""
    info, record = get_tp_info(p), grad_reduction(p)
    return (is_tp_sharded(p), is_pipeline_replica(p), info is None or info.counts_here,
            record.kind if record is not None else DENSE)


def plan_buckets(params: list, max_elements: int) -> list[list]:
    """Parameters grouped into buckets of one kind each, at most `max_elements` each (a larger
    parameter gets its own). Within a kind the parameters go in reverse order, as torch DDP does:
    backward produces the gradients of the last layers first, so a bucket's gradients arrive together
    and the first buckets can be reduce-scattered while backward still runs (overlap)."""
    out = []
    kinds = [bucket_kind(p) for p in params]        # once per parameter (the records are read, not cheap)
    for kind in _KINDS:
        run, size = [], 0
        for p in reversed([p for p, k in zip(params, kinds) if k == kind]):
            if run and size + p.numel() > max_elements:
                out.append(run)
                run, size = [], 0
            run.append(p)
            size += p.numel()
        if run:
            out.append(run)
    return out


@dataclass(eq=False)
class ZeroBucket:
    """A flat run of parameters of one param group, padded to `shard_size * dp_size`; rank r owns
    elements [r * shard_size, (r + 1) * shard_size), this rank's being `master`."""

    params: list
    offsets: list             # start of each param in the flat bucket
    numel: int                # real elements (the rest up to shard_size * dp_size is padding)
    shard_size: int
    dp_rank: int
    dp_size: int
    master: nn.Parameter      # this rank's shard, stepped by the user's optimizer (a view of `flat` when bound)
    counted: bool             # does this rank count the bucket's gradient in the global norm
    grad_shard: torch.Tensor | None = None       # reduced gradient partition (working dtype; fp32 once summed)
    ready: set = field(default_factory=set)      # params whose grad arrived (overlap hooks)
    pending: object = None                       # a reduce-scatter in flight (comm.Pending), overlap only
    flat: torch.Tensor | None = None             # the weights' flat buffer, once `bind_views` laid them out
    group: object = None                         # the group partitioning it (dp, or edp for expert weights)

    def piece(self, index: int, rank: int | None = None) -> tuple[int, int, int]:
        """(start, end, shard_start): elements [start, end) of params[index].view(-1) are rank
        `rank`'s (default: this rank's) shard[shard_start : shard_start + end - start]; start == end
        when the rank owns none of it."""
        rank = self.dp_rank if rank is None else rank
        lo, hi = rank * self.shard_size, (rank + 1) * self.shard_size
        off = self.offsets[index]
        a, b = max(lo, off), min(hi, off + self.params[index].numel())
        return (a - off, b - off, a - lo) if a < b else (0, 0, 0)

    def owned_slices(self):
        """(param, start, end, shard_start) for every param this rank owns a part of."""
        for i, p in enumerate(self.params):
            start, end, s = self.piece(i)
            if start < end:
                yield p, start, end, s

    # -- the master as the weights' own slice ------------------------------------------------------
    def views_bound(self) -> bool:
        """Every parameter still lives at its place in `flat` and the master is the owned slice (a
        cast, a `.to(device)` or a load that swaps storage breaks this; `bind_views` restores it)."""
        flat = self.flat
        if flat is None:
            return False
        base, size = flat.data_ptr(), flat.element_size()
        return (self.master.data_ptr() == base + self.dp_rank * self.shard_size * size
                and self.master.dtype == flat.dtype
                and all(p.dtype == flat.dtype and p.device == flat.device and p.data_ptr() == base + off * size
                        and p.is_contiguous() for p, off in zip(self.params, self.offsets)))

    def can_bind(self, dtype: torch.dtype) -> bool:
        """The weights hold values of the master's dtype (not meta, not yet-uncast fp32 weights of a
        half-precision run), so the master can be their slice."""
        return all(not p.is_meta and p.dtype == dtype for p in self.params) and \
            len({p.device for p in self.params}) == 1

    @torch.no_grad()
    def bind_views(self) -> None:
        """Lay the parameters out as views of one zero-padded flat buffer holding their current
        values, and make the master (the same Parameter object, so the optimizer's state stays keyed
        to it) this rank's slice of that buffer. The parameters' old storage is freed when nothing
        else holds it: the master costs no memory of its own."""
        p0 = self.params[0]
        flat = torch.zeros(self.shard_size * self.dp_size, dtype=p0.dtype, device=p0.device)
        for p, off in zip(self.params, self.offsets):
            view = flat[off:off + p.numel()]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
        own = flat[self.dp_rank * self.shard_size:(self.dp_rank + 1) * self.shard_size]
        if self.master.is_meta or self.master.device != own.device or self.master.dtype != own.dtype:
            attrs = dict(self.master.__dict__)     # set_data cannot change device or dtype: swap the tensor
            torch.utils.swap_tensors(self.master, nn.Parameter(torch.empty_like(own)))
            self.master.__dict__.update(attrs)
        self.master.data = own
        self.flat = flat

    def gather_param(self, index: int, shards: list[torch.Tensor], group, dst: int | None = None,
                     device: torch.device | None = None):
        """params[index]'s part of each shard-sized tensor in `shards` (its master, its moments),
        assembled from every rank's piece and shaped like the parameter: a collective over `group`
        (the dp group) that moves only the parameter's elements, not the bucket's. dst=None: every
        rank gets the result; dst=r: only dp rank r does (each owner sends its piece straight into
        place), the others get None. device: where the collective runs (the group's device; offloaded
        shards live on the CPU), by default each shard's own."""
        p = self.params[index]
        pieces = [self.piece(index, r) for r in range(self.dp_size)]
        start, end, s = pieces[self.dp_rank]
        if dst is not None:
            spans = [(a, b) for a, b, _ in pieces]
            full = [comm.gather_spans(t.detach()[s:s + end - start].to(device or t.device), spans, group, dst)
                    for t in shards]
            return None if full[0] is None else [f.view(p.shape) for f in full]
        width = max(b - a for a, b, _ in pieces)
        out = []
        for t in shards:
            send = torch.zeros(width, dtype=t.dtype, device=device or t.device)
            send[:end - start] = t.detach()[s:s + end - start]
            got = comm.all_gather(send, group, dim=0).view(self.dp_size, width)
            full = torch.empty(p.numel(), dtype=t.dtype, device=send.device)
            for r, (a, b, _) in enumerate(pieces):
                full[a:b] = got[r, :b - a]
            out.append(full.view(p.shape))
        return out
