"""ZeroOptimizer: ZeRO stages 1 and 2 over the data-parallel group of the mesh.

Owns where fp32 masters, optimizer states and reduced gradients live: the (tp-local) trainable
parameters of each param group are flattened into buckets (tensor-parallel shards, replicated
parameters and pipeline-tied replicas never share a bucket, so the norm counts each once), each
padded to a multiple of dp_size; dp rank r owns the r-th 1/dp of every bucket: its fp32 master
shard (which the user's optimizer steps, so the Adam moments are 1/dp too) and its reduced
gradient. `ZeroBucket.piece` is the one routine that says which elements of a parameter a rank
owns; building masters, refreshing them, exporting and importing state all read it.

    stage 1: working gradients accumulate in `param.grad` over any number of backward passes and
             are reduce-scattered once, at `step()` (or from gradient hooks with
             overlap_communication, outside `no_sync`).
    stage 2: every backward reduce-scatters the gradients and keeps only this rank's partition
             (summed over backward passes); `param.grad` is freed, so `no_sync` cannot exist.

After the inner step each rank all-gathers its updated shard (in the working dtype) back into the
working parameters. The step order (unscale, overflow, clip, skip) is MixedPrecisionOptimizer's;
this file only overrides the layout hooks. Must not re-implement the step or the norm.

Options (`ZeroConfig`): cpu_offload puts the master shards, and so the optimizer states, on the CPU
and copies the gradient shard down and the updated shard up each step (offload.py owns the copies);
communication_dtype is the dtype of the gradient reduce-scatter; master_weights=False makes the
master shards working-dtype slices (no fp32 copy: the inner optimizer steps half precision).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.optim import Optimizer

from meshboost.distributed import comm
from meshboost.distributed.param_info import get_tp_info, is_pipeline_replica, is_tp_sharded
from meshboost.optim import state as fmt
from meshboost.optim.grad_norm import counted_here
from meshboost.optim.grad_scaler import GradScalerConfig
from meshboost.optim.mixed_precision import PRECISION_DTYPES, MixedPrecisionOptimizer, _copy_into_master
from meshboost.optim.offload import HostStaging, master_device

DEFAULT_BUCKET_ELEMENTS = 12 * 1024 * 1024


@dataclass
class ZeroConfig:
    """ZeRO settings, checked when built (before any collective)."""

    stage: int = 0                       # 0: off (DDP or the pipeline reduces), 1: states, 2: + gradients
    overlap_communication: bool = False  # reduce-scatter a bucket from the gradient hook of its last parameter
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS     # elements per bucket (also the unit of overlap)
    cpu_offload: bool = False            # master shards and optimizer states in CPU memory; the inner step runs there
    communication_dtype: torch.dtype | None = None     # dtype of the gradient reduce-scatter (None: working dtype)
    master_weights: bool = True          # False: no fp32 masters, the inner optimizer steps working-dtype shards

    def __post_init__(self):
        if self.stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={self.stage!r}; expected 0, 1 or 2")
        if not isinstance(self.reduce_bucket_size, int) or self.reduce_bucket_size < 1:
            raise ValueError(f"reduce_bucket_size={self.reduce_bucket_size!r} must be a positive number of elements")
        if self.communication_dtype is not None and self.communication_dtype not in PRECISION_DTYPES.values():
            raise ValueError(f"communication_dtype={self.communication_dtype!r}; expected None (the working dtype), "
                             "torch.float32, torch.float16 or torch.bfloat16")
        self.overlap_communication = bool(self.overlap_communication)
        self.cpu_offload, self.master_weights = bool(self.cpu_offload), bool(self.master_weights)


_KINDS = [(sharded, tied, first) for sharded in (True, False) for tied in (False, True) for first in (True, False)]


def _kind(p: torch.Tensor) -> tuple[bool, bool, bool]:
    """What decides who counts a gradient in the norm: a bucket holds one kind only."""
    info = get_tp_info(p)
    return is_tp_sharded(p), is_pipeline_replica(p), info is None or info.counts_here


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
    master: nn.Parameter      # fp32 shard, stepped by the user's optimizer
    counted: bool             # does this rank count the bucket's gradient in the global norm
    grad_shard: torch.Tensor | None = None       # reduced gradient partition (working dtype)
    ready: set = field(default_factory=set)      # params whose grad arrived (overlap hooks)

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


class ZeroOptimizer(MixedPrecisionOptimizer):
    """ZeRO-`stage` (1 or 2) around the user's `optim`, over `mesh.dp_group`.

    precision / max_norm / norm_type / scaler_config / verbose: as MixedPrecisionOptimizer (fp32 works
    too: the point is then the 1/dp optimizer state). overlap_communication / reduce_bucket_size /
    cpu_offload / communication_dtype / master_weights: see `ZeroConfig`.
    """

    dp_partitioned = True
    _gathers_state = True       # per-element state and masters come back freshly gathered

    def __init__(self, optim: Optimizer, mesh, precision: str = "fp32", stage: int = 1, max_norm: float = 0.0,
                 norm_type: float = 2.0, scaler_config: GradScalerConfig | None = None,
                 overlap_communication: bool = False, reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS,
                 cpu_offload: bool = False, communication_dtype: torch.dtype | None = None,
                 master_weights: bool = True, verbose: bool = False):
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r}; ZeroOptimizer implements stages 1 and 2")
        zc = self.zero_config = ZeroConfig(stage, overlap_communication, reduce_bucket_size, cpu_offload,
                                           communication_dtype, master_weights)
        self.stage, self.overlap_communication = stage, zc.overlap_communication
        self.bucket_elements = reduce_bucket_size
        self.cpu_offload = zc.cpu_offload
        self.dp_group, self.dp_size, self.dp_rank = mesh.dp_group, mesh.dp_size, mesh.dp_rank
        # fp32 masters, or (master_weights=False) slices in the working dtype: the inner step then runs
        # in half precision, as ColossalAI's master_weights=False does.
        self.master_dtype = torch.float32 if zc.master_weights else PRECISION_DTYPES.get(precision, torch.float32)
        self.staging = HostStaging(PRECISION_DTYPES.get(precision, torch.float32)) if zc.cpu_offload else None
        super().__init__(optim, mesh, precision, max_norm, norm_type, scaler_config, verbose)
        self.communication_dtype = zc.communication_dtype or self.working_dtype
        if self.overlap_communication:
            for b in self.buckets:
                for p in b.params:
                    p.register_post_accumulate_grad_hook(self._on_grad_ready)

    @property
    def keeps_masters(self) -> bool:
        # The master shards are tensors of their own even in fp32; without fp32 masters
        # (master_weights=False) the half-precision weights are all there is.
        return self.master_dtype == torch.float32

    # -- layout ---------------------------------------------------------------------------------
    def _build_masters(self) -> None:
        self.buckets: list[ZeroBucket] = []
        self._bucket_of: dict[torch.Tensor, tuple[ZeroBucket, int]] = {}
        for group, params in zip(self.optim.param_groups, self.working_param_groups):
            group_buckets = []
            for kind in _KINDS:
                same_kind = [p for p in params if _kind(p) == kind]
                run, size = [], 0
                for p in same_kind:
                    if run and size + p.numel() > self.bucket_elements:
                        group_buckets.append(self._make_bucket(run))
                        run, size = [], 0
                    run.append(p)
                    size += p.numel()
                if run:
                    group_buckets.append(self._make_bucket(run))
            self.buckets.extend(group_buckets)
            group["params"] = [b.master for b in group_buckets]

    def _make_bucket(self, params: list) -> ZeroBucket:
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        shard_size = -(-numel // self.dp_size)
        device = master_device(params[0].device, self.cpu_offload)
        master = torch.zeros(shard_size, dtype=self.master_dtype, device=device)
        bucket = ZeroBucket(params, offsets, numel, shard_size, self.dp_rank, self.dp_size, nn.Parameter(master),
                            counted_here(params[0], self.mesh, dp_partitioned=True))
        self._copy_owned(bucket)                     # only the owned slices: no full flat copy
        for i, p in enumerate(params):
            self._bucket_of[p] = (bucket, i)
        return bucket

    @staticmethod
    @torch.no_grad()
    def _copy_owned(b: ZeroBucket) -> None:
        if any(p.is_meta for p in b.params):
            return                               # no values yet (boosted on meta): sync_masters_from_model fills them
        for p, start, end, s in b.owned_slices():
            b.master.detach()[s:s + end - start].copy_(p.detach().reshape(-1)[start:end])

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Refresh this rank's master shards from the working weights (see MixedPrecisionOptimizer)."""
        for b in self.buckets:
            _copy_into_master(b.master, None, b.params[0])
            self._copy_owned(b)

    # -- gradient reduction ------------------------------------------------------------------------
    def _reduce_bucket(self, b: ZeroBucket) -> None:
        dtype = self.communication_dtype
        parts = [p.grad.detach().reshape(-1).to(dtype) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=dtype, device=p.device) for p in b.params]
        padding = b.shard_size * self.dp_size - b.numel
        if padding:
            parts.append(torch.zeros(padding, dtype=dtype, device=parts[0].device))
        flat = torch.cat(parts)
        flat.div_(self.dp_size)               # average before summing: keeps scaled fp16 sums in range
        shard = comm.reduce_scatter(flat, self.dp_group, dim=0).to(self.working_dtype)
        b.grad_shard = shard if b.grad_shard is None else b.grad_shard.add_(shard)
        for p in b.params:
            p.grad = None
        b.ready.clear()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._grad_sync:
            return
        b, _ = self._bucket_of[p]
        b.ready.add(p)
        if len(b.ready) == len(b.params):
            self._reduce_bucket(b)

    def _flush(self) -> None:
        """Reduce every bucket that still holds unreduced working gradients (same order on every
        dp rank: buckets are built identically)."""
        for b in self.buckets:
            if any(p.grad is not None for p in b.params):
                self._reduce_bucket(b)

    def _after_backward(self) -> None:
        if self._grad_sync and (self.stage == 2 or self.overlap_communication):
            self._flush()                     # buckets whose hooks did not all fire (unused params)

    def no_sync(self):
        if self.stage == 2:
            raise RuntimeError(
                "no_sync is not available with ZeRO stage 2: each backward reduce-scatters the gradients and "
                "keeps only this rank's partition, so unreduced gradients cannot accumulate locally. Use "
                "zero_stage=1 for no_sync, or accumulate with stage 2 by calling backward several times "
                "before step() (each backward is reduced and summed into the partition)")
        return super().no_sync()

    # -- hooks of the shared step --------------------------------------------------------------------
    def _master_grads(self) -> list[tuple[torch.Tensor, bool]]:
        """The reduced gradient shards, still in the working dtype on the working device: the overflow
        check and the norm read them there (the norm accumulates in fp32 either way), and only a step
        that goes ahead pays for the fp32 copy (and, offloaded, the trip to the CPU)."""
        self._flush()
        out = []
        for b in self.buckets:
            b.master.grad = None
            if b.grad_shard is not None:
                out.append((b.grad_shard, b.counted))
        return out

    def _unscale_and_clip(self, grads, factor: float) -> None:
        live = [(i, b) for i, b in enumerate(self.buckets) if b.grad_shard is not None]
        shards = [b.grad_shard for _, b in live]
        if self.staging is not None:          # offload: the gradient shard goes to the CPU masters
            shards = self.staging.to_host([(i, shard) for (i, _), shard in zip(live, shards)])
        for (_, b), shard in zip(live, shards):
            b.master.grad = shard.to(self.master_dtype)
            if factor != 1.0:
                b.master.grad.mul_(factor)

    def _working_shard(self, index: int, b: ZeroBucket) -> torch.Tensor:
        """This rank's updated shard in the working dtype, on the working device."""
        if self.staging is not None:
            return self.staging.to_device(index, b.master, b.params[0].device)
        return b.master.detach().to(self.working_dtype)

    def _write_back(self) -> None:
        with torch.no_grad():
            for i, b in enumerate(self.buckets):
                full = comm.all_gather(self._working_shard(i, b), self.dp_group, dim=0)
                for p, off in zip(b.params, b.offsets):
                    p.copy_(full[off:off + p.numel()].view_as(p))

    def _release_grads(self) -> None:
        self._scaled_backward = False
        for b in self.buckets:
            self._clear_bucket(b)
            for p in b.params:
                p.grad = None

    def _clear_master_grads(self) -> None:
        for b in self.buckets:
            self._clear_bucket(b)

    @staticmethod
    def _clear_bucket(b: ZeroBucket) -> None:
        b.grad_shard = None
        b.master.grad = None
        b.ready.clear()

    def grad_bytes(self) -> int:
        """Bytes of reduced gradient partitions held (stage 2 between backward and step)."""
        return sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in self.buckets
                   if b.grad_shard is not None)

    # -- state by parameter: each parameter's partitions gathered over dp as it goes ----------------
    def master_weight(self, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter's fp32 master, gathered to dp rank 0 (None on the other dp ranks, and where
        the weights are the masters). A collective over dp: every dp rank calls it."""
        if param not in self._bucket_of or self.master_dtype == self.working_dtype:
            return None                          # write-back made the weights the masters, bit for bit
        b, i = self._bucket_of[param]
        full = b.gather_param(i, [b.master], self.dp_group, dst=0, device=self.mesh.device)
        return None if full is None else full[0]

    def _local_state(self, param: torch.Tensor, replica0_only: bool = False) -> tuple[dict, torch.Tensor | None]:
        b, i = self._bucket_of[param]
        state = self.optim.state.get(b.master, {})
        keys = [k for k, v in sorted(state.items()) if fmt.is_per_element(v, b.master)]
        # Only fp32 masters are exported: working-dtype master slices equal the weights bit for bit.
        masters = [b.master] if self.master_dtype == torch.float32 else []
        shards = masters + [state[k] for k in keys]
        full = b.gather_param(i, shards, self.dp_group, 0 if replica0_only else None, self.mesh.device) \
            if shards else []
        if full is None:
            return {}, None                      # another dp rank assembles this parameter's state
        master = full[0] if masters else None
        local = dict(zip(keys, full[len(masters):]))
        local.update({k: v for k, v in state.items() if k not in local})
        return local, master

    def _import_param(self, param: torch.Tensor, state: dict, master: torch.Tensor | None) -> None:
        b, i = self._bucket_of[param]
        start, end, s = b.piece(i)
        own = self.optim.state.setdefault(b.master, {})
        source = master if master is not None else param.detach()
        b.master.detach()[s:s + end - start] = source.reshape(-1)[start:end].to(self.master_dtype)
        for k, v in state.items():
            if fmt.is_per_element(v, param):
                buf = own.setdefault(k, torch.zeros_like(b.master.detach()))
                buf[s:s + end - start] = v.reshape(-1)[start:end].to(buf.device)
            else:
                own[k] = fmt.to_device(v, b.master.device)
