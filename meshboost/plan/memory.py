"""Predicted bytes of training state one rank holds after backward: weights, gradients, fp32 masters,
optimizer states, as `meshboost.optim.memory.memory_breakdown` counts them.

Owns: applying meshboost's optimizer layouts to a rank's `ParamShard`s: without ZeRO,
MixedPrecisionOptimizer's one fp32 master per half-precision weight (the weight itself in fp32);
with ZeRO-1/2, ZeroOptimizer's buckets (meshboost's own `plan_buckets` on meta tensors carrying the
shards' records; each bucket padded to a multiple of dp (of edp = dp / ep for an expert bucket), rank
r owning the r-th shard; in fp32 the
master is the owned slice of the weights' flat buffer, so only the padding inside it is new memory).
AdamW keeps two moments in the masters' dtype (fp32). Gradients after backward: full working-dtype
gradients, or the reduced shards where ZeRO has reduce-scattered them by then (stage 2; stage 1
with overlap_communication outside a pipeline). Must not allocate.
"""

from __future__ import annotations

from functools import lru_cache

from meshboost.distributed.param_info import EXPERT, grad_reduction
from meshboost.optim.precision import PRECISION_BYTES as BYTES
from meshboost.optim.zero_config import DEFAULT_BUCKET_ELEMENTS
from meshboost.optim.zero_bucket import plan_buckets
from meshboost.plan.lora import nf4_bytes

ADAM_STATES = 2            # exp_avg, exp_avg_sq (fp32 each); the step counters are scalars


def _owned_padding(numel: int, shard: int, dp_size: int, dp_rank: int) -> int:
    """Padding elements inside dp rank `dp_rank`'s shard of a bucket of `numel` real elements."""
    lo, hi = dp_rank * shard, (dp_rank + 1) * shard
    return max(0, min(hi, shard * dp_size) - max(lo, numel))


class _Same:
    """A list keyed by identity (the planner reuses one list of shards per rank), for `_bucket_runs`'s cache."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self):
        return id(self.obj)

    def __eq__(self, other):
        return isinstance(other, _Same) and other.obj is self.obj


@lru_cache(maxsize=1024)
def _bucket_runs(shards: _Same, bucket_elements: int) -> tuple[tuple[int, bool], ...]:
    """(elements, expert) of each of meshboost's `plan_buckets` over `shards` (held by the cache's key)."""
    out = []
    for run in plan_buckets([s.meta_tensor() for s in shards.obj], bucket_elements):
        record = grad_reduction(run[0])
        out.append((sum(p.numel() for p in run), record is not None and record.kind == EXPERT))
    return tuple(out)


def zero_buckets(shards, dp_size: int, dp_rank: int, ep_size: int = 1,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS) -> list[tuple[int, int, int, bool]]:
    """(real elements, partition size, this rank's index, expert) of each ZeRO bucket of a rank holding
    `shards`: meshboost's `plan_buckets`; a dense bucket is partitioned over dp, an expert one over
    the experts' replicas edp = dp / ep (this rank's edp index: dp_rank // ep)."""
    out = []
    for numel, expert in _bucket_runs(_Same(shards), bucket_elements):
        size, rank = (dp_size // ep_size, dp_rank // ep_size) if expert else (dp_size, dp_rank)
        out.append((numel, size, rank, expert))
    return out


def state_bytes(shards, precision: str, zero_stage: int, dp_size: int, dp_rank: int = 0, pp_size: int = 1,
                overlap_communication: bool = True, bucket_elements: int = DEFAULT_BUCKET_ELEMENTS,
                ep_size: int = 1) -> dict:
    """{weights, gradients, masters, optimizer_states} bytes of one rank holding `shards` (its frozen
    parameters, `shards.frozen` (LoRA's base), among the weights only: cast to the working dtype with the
    rest, or NF4 under QLoRA; no gradient, no master, no state: neither optimizer wrapper takes a parameter
    without grad)."""
    w = BYTES[precision]
    numel = sum(s.numel for s in shards)
    weights = w * numel + sum(nf4_bytes(s.numel, s.quant) if s.quant is not None else w * s.numel
                              for s in getattr(shards, "frozen", ()))
    if zero_stage == 0:
        return {"weights": weights, "gradients": w * numel,
                "masters": 0 if precision == "fp32" else 4 * numel,
                "optimizer_states": ADAM_STATES * 4 * numel}
    buckets = zero_buckets(shards, dp_size, dp_rank, ep_size, bucket_elements)
    shard_sizes = [-(-n // size) for n, size, _, _ in buckets]
    owned = sum(shard_sizes)
    reduced = zero_stage == 2 or (overlap_communication and pp_size == 1)
    if precision == "fp32":       # masters are views of the weights' padded flat buffer
        masters = 4 * sum(_owned_padding(n, s, size, rank) for (n, size, rank, _), s in zip(buckets, shard_sizes))
    else:
        masters = 4 * owned
    return {"weights": weights, "gradients": w * (owned if reduced else numel), "masters": masters,
            "optimizer_states": ADAM_STATES * 4 * owned}


def buffer_bytes(shards, precision: str, zero_stage: int, dp_size: int, pp_size: int,
                 bucket_elements: int = DEFAULT_BUCKET_ELEMENTS, ep_size: int = 1) -> int:
    """Communication buffers: torch DDP's gradient buckets (a second copy of the gradients, zero stage
    0 without a pipeline, allocated once and alive for the whole run; DDP ignores expert weights), the
    pipeline's flat all-reduce of the gradients, or ZeRO's flat reduce-scatter input of its largest
    bucket (padded; meshboost's own buckets: dense and expert weights, tp-sharded and replicated ones
    never share one) and its output shard (both in the working dtype, as `ZeroOptimizer._reduce_bucket`
    makes them) plus the fp32 gradient shards of the other buckets (`zero_buckets`)."""
    w = BYTES[precision]
    numel = sum(s.numel for s in shards)
    if zero_stage == 0 and pp_size == 1:
        numel -= sum(s.numel for s in shards if s.expert)
    if dp_size == 1 and zero_stage == 0:
        return 0
    if zero_stage == 0:
        return w * numel
    buckets = zero_buckets(shards, dp_size, 0, ep_size, bucket_elements)
    owned = [-(-n // size) for n, size, _, _ in buckets]
    if not owned:
        return 0
    largest = max(range(len(owned)), key=lambda i: owned[i] * buckets[i][1])
    out = owned[largest]
    return w * (out * buckets[largest][1] + out) + 4 * (sum(owned) - out)


def resident_buffers(buffers: int, zero_stage: int, pp_size: int) -> int:
    """The part of `buffer_bytes` allocated for the whole step, not only around the reduction: torch
    DDP's gradient buckets (zero stage 0 without a pipeline), made when the model is wrapped and kept."""
    return buffers if zero_stage == 0 and pp_size == 1 else 0
