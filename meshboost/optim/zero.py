"""ZeroOptimizer: ZeRO stages 1 and 2 over the data-parallel group of the mesh.

Owns where fp32 masters, optimizer states and reduced gradients live: the (tp-local) trainable
parameters of each param group are flattened into buckets (`zero_bucket.py`: tensor-parallel shards,
replicated parameters and pipeline-tied replicas never share a bucket, so the norm counts each once;
gradient-ready order), each padded to a multiple of dp_size; dp rank r owns the r-th 1/dp of every
bucket: its master shard (which the user's optimizer steps, so the Adam moments are 1/dp too) and its
reduced gradient. Where masters and weights share dtype and device (fp32, master_weights=False, not
offloaded) the master shard is the weights' own slice of the bucket's flat buffer: no copy.

    overlap_communication (default): each bucket's reduce-scatter starts, asynchronously, from the
             gradient hook of the last of its parameters to get a gradient, while backward goes on;
             the end of backward waits for them all (stage 1 and 2 alike, outside `no_sync`).
    stage 1: otherwise working gradients accumulate in `param.grad` over any number of backward
             passes and are reduce-scattered once, at `step()`.
    stage 2: every backward reduce-scatters the gradients and keeps only this rank's partition
             (summed over backward passes, in fp32 from the second on); `param.grad` is freed, so
             `no_sync` cannot exist; a pipeline step reduces once, when the schedule is done
             (`accumulate_then_reduce`).

After the inner step each rank all-gathers its updated shard (in the working dtype) back into the
working parameters. The step order (unscale, overflow, clip, skip) is MixedPrecisionOptimizer's;
this file only overrides the layout hooks. Must not re-implement the step or the norm.

Options (`ZeroConfig`): cpu_offload puts the master shards, and so the optimizer states, on the CPU
and copies the gradient shard down and the updated shard up each step (offload.py owns the copies);
communication_dtype is the dtype of the gradient reduce-scatter; master_weights=False makes the
master shards working-dtype slices (no fp32 copy: the inner optimizer steps half precision).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.optim import Optimizer

from meshboost.distributed import comm
from meshboost.distributed.ownership import remove_when_freed, weak_method
from meshboost.optim import state as fmt
from meshboost.optim.grad_norm import counted_here
from meshboost.optim.mixed_precision import MixedPrecisionOptimizer, _copy_into_master
from meshboost.optim.precision import PrecisionConfig, precision_config
from meshboost.optim.offload import HostStaging, master_device
from meshboost.optim.zero_bucket import ZeroBucket, plan_buckets
from meshboost.optim.zero_config import ZeroConfig

class ZeroOptimizer(MixedPrecisionOptimizer):
    """ZeRO-`stage` (1 or 2) around the user's `optim`, each bucket partitioned over the group that
    averages its parameters' gradients (the mesh's answer from their records: dp for dense weights,
    the experts' own replicas, edp, for expert-parallel ones; a bucket holds one kind).

    precision: the `PrecisionConfig`, as MixedPrecisionOptimizer's (fp32 works too: the point is then
    the 1/dp optimizer state); zero: the `ZeroConfig` (stage 1 or 2, bucket size, overlap, offload,
    communication dtype, master weights; ZeroConfig(stage=1) when None). verbose, track_grad_norm: as
    MixedPrecisionOptimizer.
    """

    dp_partitioned = True
    _gathers_state = True       # per-element state and masters come back freshly gathered

    def __init__(self, optim: Optimizer, mesh, precision: PrecisionConfig | None = None, zero: ZeroConfig | None = None,
                 *, verbose: bool = False, track_grad_norm: bool = False):
        zc = self.zero_config = ZeroConfig(stage=1) if zero is None else zero
        if not isinstance(zc, ZeroConfig):
            raise TypeError(f"ZeroOptimizer takes a meshboost.optim.ZeroConfig, got {zc!r}; pass ZeroConfig(stage=...)")
        if not zc.partitioned_by_optimizer:
            raise ValueError(f"ZeroConfig(stage={zc.stage}): ZeroOptimizer implements stages "
                             f"{ZeroConfig.OPTIMIZER_STAGES} (stage 3 is torch FSDP2's: HybridParallelPlugin(zero_stage=3))")
        working = precision_config(precision).dtype
        # fp32 masters, or (master_weights=False) slices in the working dtype: the inner step then runs
        # in half precision, as ColossalAI's master_weights=False does.
        self.master_dtype = torch.float32 if zc.master_weights else working
        self.staging = HostStaging(working) if zc.cpu_offload else None
        super().__init__(optim, mesh, precision, verbose=verbose, track_grad_norm=track_grad_norm)
        self.communication_dtype = zc.communication_dtype or self.working_dtype
        if self.overlap_communication:
            # held by the parameters' autograd state (C++, unseen by Python's collector): a hook holding
            # the optimizer strongly would keep it, its masters and states alive for the whole process
            on_grad_ready = weak_method(self._on_grad_ready)
            remove_when_freed(self, [p.register_post_accumulate_grad_hook(on_grad_ready)
                                     for b in self.buckets for p in b.params])

    # the layout, read from the one config
    @property
    def stage(self) -> int:
        return self.zero_config.stage

    @property
    def overlap_communication(self) -> bool:
        return self.zero_config.overlap_communication

    @property
    def bucket_elements(self) -> int:
        return self.zero_config.reduce_bucket_size

    @property
    def cpu_offload(self) -> bool:
        return self.zero_config.cpu_offload

    @property
    def keeps_masters(self) -> bool:
        # fp32 masters apart from half-precision weights. fp32 training: the master shard is the
        # weights' own slice (or, offloaded, a host copy equal to them bit for bit); without fp32
        # masters (master_weights=False) the half-precision weights are all there is.
        return self.master_dtype == torch.float32 and self.working_dtype != torch.float32

    # -- layout ---------------------------------------------------------------------------------
    def _build_masters(self) -> None:
        self.buckets: list[ZeroBucket] = []
        self._bucket_of: dict[torch.Tensor, tuple[ZeroBucket, int]] = {}
        for group, params in zip(self.optim.param_groups, self.working_param_groups):
            group_buckets = [self._make_bucket(run) for run in plan_buckets(params, self.bucket_elements)]
            self.buckets.extend(group_buckets)
            group["params"] = [b.master for b in group_buckets]

    @property
    def _masters_are_weights(self) -> bool:
        """Masters of the weights' own dtype on the weights' device (fp32 training, master_weights=False,
        not offloaded): each master is the owned slice of its bucket's flat weight buffer, no copy."""
        return self.master_dtype == self.working_dtype and self.staging is None

    def _bind(self, b: ZeroBucket) -> bool:
        """Make `b`'s master the weights' own slice if it can be and is not already (the weights were
        cast, moved, or loaded into new storage since); True when it is."""
        if not self._masters_are_weights:
            return False
        if b.views_bound():
            return True
        if not b.can_bind(self.master_dtype):
            return False                 # meta, or fp32 weights not yet cast to the working dtype
        b.bind_views()
        return True

    def _make_bucket(self, params: list) -> ZeroBucket:
        offsets, numel = [], 0
        for p in params:
            offsets.append(numel)
            numel += p.numel()
        # the group the parameters' records say averages their gradients (one kind per bucket)
        _, group, size, rank = self.mesh.reduction_of(params)
        shard_size = -(-numel // size)
        bucket = ZeroBucket(params, offsets, numel, shard_size, rank, size, None,
                            counted_here(params[0], self.mesh, dp_partitioned=True), group=group)
        if self._masters_are_weights and bucket.can_bind(self.master_dtype):
            bucket.master = nn.Parameter(torch.empty(0, dtype=self.master_dtype, device=params[0].device))
            bucket.bind_views()                      # the master is the weights' owned slice: no copy
        else:
            device = master_device(params[0].device, self.cpu_offload)
            bucket.master = nn.Parameter(torch.zeros(shard_size, dtype=self.master_dtype, device=device))
            self._copy_owned(bucket)                 # only the owned slices: no full flat copy
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
        """Refresh this rank's master shards from the working weights (see MixedPrecisionOptimizer);
        where the masters are the weights, lay the (re)loaded weights out in their flat buffer again."""
        for b in self.buckets:
            if self._bind(b):
                continue
            _copy_into_master(b.master, None, b.params[0])
            self._copy_owned(b)

    # -- gradient reduction ------------------------------------------------------------------------
    def _reduce_bucket(self, b: ZeroBucket, wait: bool = True) -> None:
        """Reduce-scatter the bucket's working gradients (then freed) into its partition; wait=False
        leaves the collective in flight (`_finish` adds it in)."""
        dtype = self.communication_dtype
        parts = [p.grad.detach().reshape(-1).to(dtype) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=dtype, device=p.device) for p in b.params]
        padding = b.shard_size * b.dp_size - b.numel
        if padding:
            parts.append(torch.zeros(padding, dtype=dtype, device=parts[0].device))
        flat = torch.cat(parts)
        flat.div_(b.dp_size)               # average before summing: keeps scaled fp16 sums in range
        self._finish(b)                       # one reduction in flight per bucket (a hook that fired twice)
        b.pending = comm.reduce_scatter_async(flat, b.group, dim=0)
        for p in b.params:
            p.grad = None
        b.ready.clear()
        if wait:
            self._finish(b)

    def _finish(self, b: ZeroBucket) -> None:
        """Wait for the bucket's reduce-scatter in flight and add it to the partition. A second
        backward's partition is summed in fp32 (the masters' precision), not in the half working
        dtype: accumulation over micro-steps does not round at every addition."""
        if b.pending is None:
            return
        shard, b.pending = b.pending.wait().to(self.working_dtype), None
        if b.grad_shard is None:
            b.grad_shard = shard
        elif b.grad_shard.dtype == torch.float32:
            b.grad_shard.add_(shard)
        else:
            b.grad_shard = b.grad_shard.float().add_(shard)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._grad_sync:
            return
        b, _ = self._bucket_of[p]
        b.ready.add(p)
        if len(b.ready) == len(b.params):
            self._reduce_bucket(b, wait=False)    # in flight while backward goes on

    def _flush(self) -> None:
        """Reduce every bucket that still holds unreduced working gradients, then wait for every
        reduction in flight (same order on every dp rank: buckets are built identically, and hooks
        complete them in the same gradient-ready order)."""
        for b in self.buckets:
            if any(p.grad is not None for p in b.params):
                self._reduce_bucket(b, wait=False)
        for b in self.buckets:
            self._finish(b)

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

    @contextlib.contextmanager
    def accumulate_then_reduce(self):
        """Gradients of every backward inside the block accumulate locally in `param.grad` (a pipeline
        step's micro-batches); leaving it, stage 2 reduce-scatters them once and frees the full
        gradients, stage 1 leaves them for step() (as no_sync). Not for users' accumulation under stage
        2: that is several backward passes before step, each reduced (summed in fp32)."""
        previous, self._grad_sync = self._grad_sync, False
        try:
            yield
        finally:
            self._grad_sync = previous
        if self.stage == 2 and previous:
            self._flush()

    # -- hooks of the shared step --------------------------------------------------------------------
    def _master_grads(self) -> list[tuple[torch.Tensor, bool]]:
        """The reduced gradient shards, still in the working dtype on the working device: the overflow
        check and the norm read them there (the norm accumulates in fp32 either way), and only a step
        that goes ahead pays for the fp32 copy (and, offloaded, the trip to the CPU)."""
        self._flush()
        out = []
        for b in self.buckets:
            self._bind(b)                     # the weights were cast or moved since boost: views again
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
                if b.views_bound():           # the master is the owned slice: gather the others in place
                    comm.all_gather_into(b.flat, b.master.detach(), b.group)
                    continue
                full = comm.all_gather(self._working_shard(i, b), b.group, dim=0)
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
        if b.pending is not None:
            b.pending.wait()                  # a reduction still in flight (zero_grad before step)
            b.pending = None
        b.grad_shard = None
        b.master.grad = None
        b.ready.clear()

    def grad_bytes(self) -> int:
        """Bytes of reduced gradient partitions held (stage 2 between backward and step)."""
        return sum(b.grad_shard.numel() * b.grad_shard.element_size() for b in self.buckets
                   if b.grad_shard is not None)

    def _check_carried(self, carried: dict[torch.Tensor, dict]) -> str | None:
        """A bucket's partition is one tensor the user's optimizer steps with one set of scalars (Adam's
        step): carried state is exact only where every parameter of a bucket has state and the same
        scalars. Checked for every bucket before anything is installed."""
        for b in self.buckets:
            have = [p for p in b.params if p in carried]
            if not have:
                continue
            scalars = [{k: v.item() if torch.is_tensor(v) else v for k, v in carried[p].items()
                        if not (torch.is_tensor(v) and v.dim() > 0)} for p in have]
            if len(have) < len(b.params) or any(sc != scalars[0] for sc in scalars):
                seen = sorted({repr(sc) for sc in scalars} | ({"no state"} if len(have) < len(b.params) else set()))
                shapes = [tuple(p.shape) for p in b.params]
                return (
                    f"zero_stage={self.stage}: the optimizer already stepped, and {len(shapes)} parameters ZeRO "
                    f"partitions together (shapes {shapes[:4]}{' ...' if len(shapes) > 4 else ''}) have different "
                    f"optimizer scalars ({', '.join(seen)}); ZeRO keeps one state per bucket, so their next steps "
                    "would not be the unboosted optimizer's. Boost the optimizer before its first step, step every "
                    "parameter alike before boosting, or use zero_stage=0 (per-parameter state)")
        return None

    # -- state by parameter: each parameter's partitions gathered over dp as it goes ----------------
    def master_weight(self, param: torch.Tensor) -> torch.Tensor | None:
        """The parameter's fp32 master, gathered to dp rank 0 (None on the other dp ranks, and where
        the weights are the masters). A collective over dp: every dp rank calls it."""
        if param not in self._bucket_of or self.master_dtype == self.working_dtype:
            return None                          # write-back made the weights the masters, bit for bit
        b, i = self._bucket_of[param]
        full = b.gather_param(i, [b.master], b.group, dst=0, device=self.mesh.device)
        return None if full is None else full[0]

    def _local_state(self, param: torch.Tensor, replica0_only: bool = False) -> tuple[dict, torch.Tensor | None]:
        b, i = self._bucket_of[param]
        state = self.optim.state.get(b.master, {})
        keys = [k for k, v in sorted(state.items()) if fmt.is_per_element(v, b.master)]
        # Only fp32 masters are exported: working-dtype master slices equal the weights bit for bit.
        masters = [b.master] if self.master_dtype == torch.float32 else []
        shards = masters + [state[k] for k in keys]
        full = b.gather_param(i, shards, b.group, 0 if replica0_only else None, self.mesh.device) \
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
