"""The records a parameter carries, and the one routine that maps a full tensor onto tp shards.

Owns: `TensorParallelInfo` (which dim is split, over which group, the full shape, vocab padding,
fused blocks), `PipelineTie` (a weight held by several pipeline stages), `GradReduction` (the kind
of parameter, which the mesh maps to the axes that average its gradient) and the gradient hooks
meshboost registers, each attached to the parameter itself; `carry_records` / `carry_grad_hooks`, the
one way to move them to a parameter that replaces another (FSDP2's DTensors); `local_slices`, the
only code that knows which slices of a full tensor make up this rank's shard, and the shard/gather
functions built on it. Grad-norm, ZeRO, sharding, pipelines and checkpoints read the records; none
of them re-derives a layout from module types.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Callable

import torch

from meshboost.distributed import comm
from meshboost.distributed.quantized import dequantized, is_nf4, nf4_shard

_TP_ATTR = "tp_info"
_TIE_ATTR = "pipeline_tie"
_HOOKS_ATTR = "grad_hooks"
_REDUCE_ATTR = "grad_reduction"

DENSE = "dense"          # a parameter whose gradient is averaged over the dp replicas
EXPERT = "expert"        # an expert-parallel weight: averaged over its experts' own replicas (the edp axis)


@dataclass
class TensorParallelInfo:
    """How one parameter is split over its tensor-parallel group.

    The global tensor is `full_shape`; along `dim` it is zero-padded to `padded_size` (vocab
    padding; equal to full_shape[dim] otherwise), viewed as `num_fused` equal blocks (GPT-2's
    fused [q | k | v] has 3), and each block is cut into `num_shards` = tp_size / replicas
    contiguous chunks; rank r holds chunk r // replicas of every block, concatenated. `replicas` > 1
    when there are fewer pieces than ranks (key/value heads fewer than tp): consecutive ranks then
    hold the same chunk, and its gradient is summed over them.

    An expert-parallel weight (packed experts `[E, ...]`) is also split on dim 0 into `expert_size`
    contiguous runs of experts over `expert_group`, this rank holding run `expert_rank`; the tp split
    (when tp_size > 1) is then inside each expert, on another dim. A LoRA factor on packed experts
    interleaves them (peft's lora_B `[out, r E]`, column j E + e): `expert_dim` 1 viewed as
    `expert_blocks` = r blocks of E, this rank holding its run of every block (shardformer/lora_experts.py).
    """

    dim: int
    full_shape: tuple[int, ...]
    padded_size: int
    tp_rank: int
    tp_size: int
    num_fused: int = 1
    group: object = field(default=None, repr=False, compare=False)
    replicas: int = 1
    expert_size: int = 1
    expert_rank: int = 0
    expert_group: object = field(default=None, repr=False, compare=False)
    expert_dim: int = 0
    expert_blocks: int = 1
    # unequal fused blocks along `dim` (a recurrent mixer's in_proj [z | x | B | C | dt]: each segment
    # split over tp on its own); empty: `num_fused` equal blocks
    block_sizes: tuple[int, ...] = ()

    @property
    def blocks(self) -> tuple[int, ...]:
        """The sizes of the fused blocks along `dim` (one block when nothing is fused)."""
        return self.block_sizes or (self.padded_size // self.num_fused,) * self.num_fused

    @property
    def padding(self) -> int:
        return self.padded_size - self.full_shape[self.dim]

    @property
    def num_shards(self) -> int:
        return self.tp_size // self.replicas

    @property
    def shard_index(self) -> int:
        return self.tp_rank // self.replicas

    @property
    def local_size(self) -> int:
        return self.padded_size // self.num_shards

    @property
    def local_experts(self) -> int:
        """Experts (rows of `expert_dim`, per block) this rank holds of an expert-parallel weight."""
        return self.full_shape[self.expert_dim] // self.expert_blocks // self.expert_size

    @property
    def counts_here(self) -> bool:
        """False on every copy but the first of a replicated shard (norms count each value once)."""
        return self.tp_rank % self.replicas == 0


@dataclass(frozen=True)
class PipelineTie:
    """A weight that several pipeline stages hold (an embedding tied to the LM head). `replica` is
    True on every holder but the lowest pipeline rank: its gradient is summed with the others', and
    it is not counted a second time in the gradient norm."""

    replica: bool


@dataclass(frozen=True)
class GradReduction:
    """Which kind of parameter this is for the gradient reduction: the mesh maps the kind to the axes
    its gradient is averaged over (`ParallelMesh.reduction_axes`: "dense" -> ("dp",); with a context
    axis ("dp", "cp"); an expert weight -> the experts' own data-parallel axis). The record says what
    the parameter is; the mesh, not each optimizer, says who reduces it."""

    kind: str = DENSE


def grad_reduction(param: torch.Tensor) -> GradReduction | None:
    """The parameter's reduction record, or None (a dense parameter)."""
    return getattr(param, _REDUCE_ATTR, None)


def set_grad_reduction(param: torch.Tensor, record: GradReduction) -> None:
    setattr(param, _REDUCE_ATTR, record)


def get_tp_info(param: torch.Tensor) -> TensorParallelInfo | None:
    """The record of a tensor-parallel parameter, or None for a replicated one."""
    return getattr(param, _TP_ATTR, None)


def set_tp_info(param: torch.Tensor, info: TensorParallelInfo) -> None:
    setattr(param, _TP_ATTR, info)


def is_tp_sharded(param: torch.Tensor) -> bool:
    info = get_tp_info(param)
    return info is not None and info.tp_size > 1


def is_dtensor(tensor: torch.Tensor) -> bool:
    """A torch DTensor (FSDP2's parameters)? Asked without importing torch.distributed.tensor (half a
    second of `import meshboost`): until something imported it, no tensor can be one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def get_pipeline_tie(param: torch.Tensor) -> PipelineTie | None:
    return getattr(param, _TIE_ATTR, None)


def set_pipeline_tie(param: torch.Tensor, tie: PipelineTie) -> None:
    setattr(param, _TIE_ATTR, tie)


def is_pipeline_replica(param: torch.Tensor) -> bool:
    """True for the last stage's copy of a weight tied across pipeline stages."""
    tie = get_pipeline_tie(param)
    return tie is not None and tie.replica


# -- gradient hooks, and moving every record to a replacement parameter ---------------------------
def register_grad_hook(param: torch.Tensor, hook: Callable) -> torch.utils.hooks.RemovableHandle | None:
    """`param.register_hook(hook)`, recorded on the parameter so `carry_grad_hooks` can put the same
    hook on a tensor that replaces it. The way meshboost registers a gradient hook on a parameter
    (the sums over tp: replicated kv-head shards, shared q/k norms, sequence-parallel weights). A frozen
    parameter (a base weight under LoRA) has no gradient to hook: the hook is only recorded (None)."""
    handle = param.register_hook(hook) if param.requires_grad else None
    setattr(param, _HOOKS_ATTR, (*getattr(param, _HOOKS_ATTR, ()), hook))
    return handle


def grad_hooks(param: torch.Tensor) -> tuple[Callable, ...]:
    """The gradient hooks meshboost registered on `param` (`register_grad_hook`), in the order they were
    registered (the order autograd runs them). Read from the record only: every meshboost call site
    registers through `register_grad_hook` (tests/test_architecture.py refuses a bare `register_hook`
    on a parameter), so torch's private hook table is never read."""
    return getattr(param, _HOOKS_ATTR, ())


@dataclass(frozen=True)
class ParamRecords:
    """Everything meshboost records on one parameter, taken off it to be put on its replacement."""

    tp_info: TensorParallelInfo | None
    pipeline_tie: PipelineTie | None
    grad_hooks: tuple[Callable, ...]
    grad_reduction: GradReduction | None = None


def records_of(param: torch.Tensor) -> ParamRecords:
    return ParamRecords(get_tp_info(param), get_pipeline_tie(param), grad_hooks(param), grad_reduction(param))


def attach_records(param: torch.Tensor, records: ParamRecords) -> None:
    """Put `records` on `param` (a parameter that replaced the one they were taken from). The gradient
    hooks are recorded, not registered: `carry_grad_hooks` registers them where autograd will see them."""
    for attr, value in ((_TP_ATTR, records.tp_info), (_TIE_ATTR, records.pipeline_tie),
                        (_REDUCE_ATTR, records.grad_reduction)):
        if value is not None:
            setattr(param, attr, value)
    if records.grad_hooks:
        setattr(param, _HOOKS_ATTR, records.grad_hooks)


def carry_records(src: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst` replaces `src`: give it `src`'s tensor-parallel record, pipeline tie and gradient-hook record."""
    attach_records(dst, records_of(src))


def carry_grad_hooks(src: torch.Tensor, dst: torch.Tensor) -> None:
    """Register on `dst` every gradient hook `src` has (`grad_hooks`), the same callables in the same
    order, so autograd runs on `dst`'s gradient exactly what it ran on `src`'s."""
    for hook in grad_hooks(src):
        register_grad_hook(dst, hook)


# -- the shard layout -----------------------------------------------------------------------------
def local_slices(info: TensorParallelInfo, block: int = 0) -> list[tuple[tuple, int]]:
    """(index into the full tensor, zero rows to append after it) pieces whose concatenation along
    `info.dim` is this rank's shard (of expert block `block`: `shard_from` concatenates the blocks along
    `info.expert_dim`): one piece per fused block; the last rank's piece of a padded dim is short and is
    completed with zeros."""
    dim, size = info.dim, info.full_shape[info.dim]
    if info.num_fused > 1:
        ranges, start = [], 0
        for block_size in info.blocks:
            part = block_size // info.num_shards
            ranges.append((start + info.shard_index * part, start + (info.shard_index + 1) * part, 0))
            start += block_size
    else:
        local = info.local_size
        start = info.shard_index * local
        stop = min(start + local, size)
        ranges = [(min(start, size), stop, local - max(stop - start, 0))]
    rank = len(info.full_shape)
    experts = slice(None)
    if info.expert_size > 1:                  # this rank's run of experts (the tp dim is another)
        start = block * info.full_shape[info.expert_dim] // info.expert_blocks + info.expert_rank * info.local_experts
        experts = slice(start, start + info.local_experts)
    return [(tuple(slice(a, b) if d == dim else experts if d == info.expert_dim else slice(None)
                   for d in range(rank)), pad) for a, b, pad in ranges]


def shard_from(read_slice: Callable[[tuple], torch.Tensor], full_shape: tuple[int, ...], info: TensorParallelInfo,
               what: str) -> torch.Tensor:
    """This rank's shard (zero-padded like the parameter) of a full tensor of `full_shape`, built
    from `read_slice(index)` calls that each return `full[index]`, so a reader of a file reads only
    the owned slices. Raises naming `what` when the full shape is not the record's."""
    if tuple(full_shape) != tuple(info.full_shape):
        raise ValueError(f"{what} has shape {tuple(full_shape)}, the model expects {tuple(info.full_shape)}; "
                         "the checkpoint belongs to another configuration")
    blocks = []
    for block in range(info.expert_blocks if info.expert_size > 1 else 1):
        parts = []
        for index, pad in local_slices(info, block):
            t = read_slice(index)
            if pad:
                shape = list(t.shape)
                shape[info.dim] = pad
                t = torch.cat([t, t.new_zeros(shape)], dim=info.dim)
            parts.append(t)
        blocks.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=info.dim))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=info.expert_dim)


def shard_tensor(full: torch.Tensor, info: TensorParallelInfo) -> torch.Tensor:
    """This rank's shard of the full (unpadded) tensor, as a new tensor (it never keeps the full
    tensor's storage alive). A frozen NF4 weight is cut from its own quantized bytes (`quantized.py`)."""
    if is_nf4(full):
        pieces = local_slices(info)
        if info.expert_size > 1 or any(pad for _, pad in pieces):
            raise ValueError(f"an NF4 weight of shape {tuple(full.shape)} would need padding or an expert split "
                             f"({info}); quantize only dense linears whose split dims divide by tp")
        return nf4_shard(full, [index for index, _ in pieces])
    return shard_from(full.__getitem__, tuple(full.shape), info, "tensor").clone(memory_format=torch.contiguous_format)


def unshard_gathered(gathered: torch.Tensor, info: TensorParallelInfo) -> torch.Tensor:
    """Reorder rank-concatenated shards into the full tensor, dropping padding (the inverse of
    `local_slices` applied on every rank)."""
    dim = info.dim % gathered.dim()
    if info.replicas > 1:                                                # one copy of each shard
        gathered = torch.cat(gathered.chunk(info.tp_size, dim=dim)[::info.replicas], dim=dim)
    if info.num_fused > 1:
        per_rank = gathered.chunk(info.num_shards, dim=dim)              # [r0: q0 k0 v0 | r1: ...]
        parts = [b // info.num_shards for b in info.blocks]
        pieces = [p.split(parts, dim=dim) for p in per_rank]
        gathered = torch.cat([pieces[r][f] for f in range(info.num_fused) for r in range(info.num_shards)],
                             dim=dim)
    if info.padding:
        gathered = gathered.narrow(dim, 0, info.full_shape[dim])
    return gathered.contiguous()


def gather_tensor(local: torch.Tensor, info: TensorParallelInfo | None, group=None) -> torch.Tensor:
    """The full, unpadded tensor from every rank's shard (a collective over the tp group).

    `local` may be the parameter or any tensor laid out like it (its gradient, an Adam moment). An
    expert-parallel weight is then gathered over its expert group too (every rank of it calls this).
    """
    local = dequantized(local)          # a frozen NF4 weight gathers as the values it computes with
    if info is None:
        return local
    if info.tp_size == 1:
        full = local if not info.padding else local.narrow(info.dim, 0, info.full_shape[info.dim])
    else:
        gathered = comm.all_gather(local.detach(), group if group is not None else info.group, dim=info.dim)
        full = unshard_gathered(gathered, info)
    if info.expert_size > 1:
        full = comm.all_gather(full.detach().contiguous(), info.expert_group, dim=info.expert_dim)
        if info.expert_blocks > 1:         # [rank 0: its run of every block | rank 1: ...] -> block by block
            runs = [r.chunk(info.expert_blocks, dim=info.expert_dim)
                    for r in full.chunk(info.expert_size, dim=info.expert_dim)]
            full = torch.cat([runs[r][b] for b in range(info.expert_blocks) for r in range(info.expert_size)],
                             dim=info.expert_dim)
    return full


def full_on_cpu(local: torch.Tensor, info: TensorParallelInfo | None, reuse: bool = False) -> torch.Tensor:
    """`gather_tensor`, on the CPU, as a compact tensor the caller may keep: copied only when it would
    alias live state (`local` is a parameter or an optimizer moment; reuse=True says `local` is a
    temporary the caller built, whose storage may be handed back) or is a view into a larger storage
    (torch.save would write all of it)."""
    full = gather_tensor(local.detach(), info).to("cpu")
    storage = full.untyped_storage()
    aliased = not reuse and not is_nf4(local) and storage.data_ptr() == local.untyped_storage().data_ptr()
    if aliased or not full.is_contiguous() or storage.nbytes() != full.numel() * full.element_size():
        full = full.clone(memory_format=torch.contiguous_format)
    return full


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape `tensor` has unsharded and unpadded (its record's, else its own)."""
    info = get_tp_info(tensor)
    return tuple(info.full_shape) if info is not None else tuple(tensor.shape)


def replace_keeping_object(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give `tensor` (a meta parameter or buffer) `value`'s storage while keeping the same Python object
    (an optimizer built before stays valid), its attributes (this module's tensor-parallel record) and
    the gradient hooks meshboost registered on it (`register_grad_hook`: expert parallelism's 1/ep,
    the sums over tp), which `swap_tensors` leaves behind with the old storage."""
    attrs = dict(tensor.__dict__)
    replacement = torch.nn.Parameter(value, requires_grad=tensor.requires_grad) \
        if isinstance(tensor, torch.nn.Parameter) else value
    torch.utils.swap_tensors(tensor, replacement)
    tensor.__dict__.update(attrs)
    if tensor.requires_grad and grad_hooks(tensor):
        # the old hook table came along but is wired to no autograd node: a fresh one, then meshboost's
        # recorded hooks (already in the record: registered only)
        tensor._backward_hooks = None
        for hook in grad_hooks(tensor):
            tensor.register_hook(hook)
