"""The record a sharded parameter carries, and the shard/gather maths that reads it.

Owns: `TensorParallelInfo` (which dim is split, over which group, the full shape, vocab padding,
fused blocks) attached to the parameter itself, plus `shard_tensor` / `gather_tensor`, the only
code that knows how a full tensor maps onto tp shards. Grad-norm, ZeRO and checkpoints read the
record; none of them re-derive layouts from module types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from meshboost.shardformer import comm

_ATTR = "tp_info"


@dataclass
class TensorParallelInfo:
    """How one parameter is split over its tensor-parallel group.

    The global tensor is `full_shape`; along `dim` it is zero-padded to `padded_size` (vocab
    padding; equal to full_shape[dim] otherwise), viewed as `num_fused` equal blocks (GPT-2's
    fused [q | k | v] has 3), and each block is cut into `tp_size` contiguous chunks; rank r holds
    chunk r of every block, concatenated.
    """

    dim: int
    full_shape: tuple[int, ...]
    padded_size: int
    tp_rank: int
    tp_size: int
    num_fused: int = 1
    group: object = field(default=None, repr=False, compare=False)

    @property
    def padding(self) -> int:
        return self.padded_size - self.full_shape[self.dim]

    @property
    def local_size(self) -> int:
        return self.padded_size // self.tp_size


def get_tp_info(param: torch.Tensor) -> TensorParallelInfo | None:
    """The record of a tensor-parallel parameter, or None for a replicated one."""
    return getattr(param, _ATTR, None)


def set_tp_info(param: torch.Tensor, info: TensorParallelInfo) -> None:
    setattr(param, _ATTR, info)


def is_tp_sharded(param: torch.Tensor) -> bool:
    info = get_tp_info(param)
    return info is not None and info.tp_size > 1


def padded_size(size: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that holds `size`."""
    return -(-size // multiple) * multiple


def shard_tensor(full: torch.Tensor, info: TensorParallelInfo) -> torch.Tensor:
    """This rank's shard of the full (unpadded) tensor, as the record describes it."""
    dim = info.dim % full.dim()
    if info.padding:
        pad = [0, 0] * (full.dim() - dim - 1) + [0, info.padding]
        full = F.pad(full, pad)
    blocks = full.chunk(info.num_fused, dim=dim)
    return torch.cat([b.chunk(info.tp_size, dim=dim)[info.tp_rank] for b in blocks], dim=dim).contiguous()


def unshard_gathered(gathered: torch.Tensor, info: TensorParallelInfo) -> torch.Tensor:
    """Reorder rank-concatenated shards into the full tensor, dropping padding."""
    dim = info.dim % gathered.dim()
    if info.num_fused > 1:
        per_rank = gathered.chunk(info.tp_size, dim=dim)                 # [r0: q0 k0 v0 | r1: ...]
        pieces = [p.chunk(info.num_fused, dim=dim) for p in per_rank]
        gathered = torch.cat([pieces[r][f] for f in range(info.num_fused) for r in range(info.tp_size)], dim=dim)
    if info.padding:
        gathered = gathered.narrow(dim, 0, info.full_shape[dim])
    return gathered.contiguous()


def gather_tensor(local: torch.Tensor, info: TensorParallelInfo | None, group=None) -> torch.Tensor:
    """The full, unpadded tensor from every rank's shard (a collective over the tp group).

    `local` may be the parameter or any tensor laid out like it (its gradient, an Adam moment).
    """
    if info is None or info.tp_size == 1:
        return local if info is None or not info.padding else local.narrow(info.dim, 0, info.full_shape[info.dim])
    gathered = comm.all_gather(local.detach(), group if group is not None else info.group, dim=info.dim)
    return unshard_gathered(gathered, info)
