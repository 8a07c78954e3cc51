"""The global gradient norm, written once and used by every optimizer wrapper.

Owns: the rule for which rank counts which gradient (so the norm over a (dp, pp, tp) mesh equals
the unsharded model's norm), the one all-reduce that combines the partial sums, and the clip
coefficient. Must not know any layout beyond the parameter's tensor-parallel record and whether
the caller's gradients are partitioned over dp (ZeRO) or replicated (DDP).

Counting rule, with one SUM (or MAX for the inf-norm) over the world group of the mesh:
  * tensor-parallel shards (a `get_tp_info` record with tp_size > 1) are disjoint: every tp rank
    counts its own shard (a shard several ranks hold, kv heads fewer than tp, only on its first
    holder). Parameters without a record are identical on every tp rank: only tp rank 0 counts them.
  * pipeline stages hold disjoint parameters: every stage counts its own, except a weight tied
    across stages (GPT-2's embedding and LM head), whose last-stage replica carries a
    `PipelineTie(replica=True)` record (`meshboost.distributed.param_info`) and is not counted.
  * ZeRO partitions are disjoint over dp: every dp rank counts its own partition. Without ZeRO
    the reduced gradients are identical over dp: only dp rank 0 counts them.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

from meshboost.distributed import comm
from meshboost.distributed.param_info import get_tp_info, is_pipeline_replica, is_tp_sharded


def counted_here(param: torch.Tensor, mesh, dp_partitioned: bool) -> bool:
    """True when this rank contributes `param`'s gradient (or its ZeRO partition) to the norm."""
    if is_pipeline_replica(param):
        return False
    if not is_tp_sharded(param) and mesh.tp_rank != 0:
        return False
    if is_tp_sharded(param) and not get_tp_info(param).counts_here:      # a replicated kv-head shard
        return False
    if not dp_partitioned and mesh.reduction_rank(param) != 0:     # a replica of the gradient its group averaged
        return False
    return True


def local_norm_power(grads: Iterable[torch.Tensor], norm_type: float = 2.0,
                     device: torch.device | None = None) -> torch.Tensor:
    """sum |g|^p over `grads` (or max |g| for p = inf), accumulated in fp32, as a 1-element tensor
    (on `device` when this rank counts no gradient, e.g. a stage holding only frozen weights)."""
    grads = [g for g in grads if g is not None and g.numel()]
    if not grads:
        return torch.zeros(1, dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return torch.stack([g.detach().abs().max().float() for g in grads]).max().reshape(1)
    norms = torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) for g in grads])
    return norms.pow(norm_type).sum().reshape(1)


def global_grad_norm(grads: Iterable[torch.Tensor], group, norm_type: float = 2.0,
                     device: torch.device | None = None) -> float:
    """The norm over every rank of `group` of the gradients each rank counts (see the module
    docstring for who counts what). inf or nan when any counted gradient is. `device`: where the
    collective runs when this rank counts nothing (the mesh's device)."""
    if norm_type <= 0:
        raise ValueError(f"norm_type={norm_type!r} must be positive (2.0 or float('inf'))")
    partial = local_norm_power(grads, norm_type, device)
    if device is not None and partial.device != torch.device(device):
        partial = partial.to(device)       # offloaded (CPU) gradients: NCCL reduces device tensors only
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    if dist.is_initialized():
        comm.all_reduce(partial, group, op=op)
    total = partial.item()
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor that brings `total_norm` down to `max_norm` (1.0 when already below or disabled),
    as torch.nn.utils.clip_grad_norm_ computes it."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
