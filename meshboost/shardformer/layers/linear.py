"""Column- and row-parallel linear layers, for `nn.Linear` and GPT-2's `Conv1D`.

Owns: building a parallel layer from an already-loaded native module (`nn.Linear`, or GPT-2's
`Conv1D`, whose transposed weight the same classes handle) by slicing its *own*
parameters in place (the same `nn.Parameter` objects keep living, now holding shards, so an
optimizer built before sharding stays valid) and the forward that wires in the collectives.

Convention (docs/conventions.md): "column parallel" splits the OUTPUT features: `nn.Linear`
weight dim 0 ([out, in]), GPT-2 `Conv1D` weight dim 1 ([in, out]). "Row parallel" splits the
INPUT features: `nn.Linear` dim 1, `Conv1D` dim 0.

Must not decide where a layer sits: whether a column applies Megatron's f itself, whether the
sequence is split around it, and which block region encloses it come in its `LinearRole`, decided
once by the sharder's plan (`regions.py`); a layer only follows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from meshboost.distributed import comm
from meshboost.distributed.param_info import (
    TensorParallelInfo,
    get_tp_info,
    register_grad_hook,
    set_tp_info,
    shard_tensor,
)
from meshboost.distributed.quantized import is_nf4, set_data_
from meshboost.shardformer.layers.overlap import deferred_linear
from meshboost.shardformer.regions import LinearRole, SequenceLayoutError


def is_conv1d(module: nn.Module) -> bool:
    # transformers' GPT-2 Conv1D: weight [nx, nf] and an attribute `nf`; checked by name so this
    # file does not import transformers.
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def shard_parameter_(param: nn.Parameter, dim: int, group, num_fused: int = 1,
                     pad_to_multiple: int = 1, replicas: int = 1, blocks: tuple[int, ...] = ()) -> nn.Parameter:
    """Replace `param`'s data by this rank's shard along `dim` and attach its record.

    replicas > 1: the dim is cut into tp_size / replicas shards, each held by `replicas`
    consecutive ranks, whose gradients are summed over them as they are produced (key/value heads
    fewer than tp). blocks: unequal fused blocks along `dim` (their sizes), each split on its own
    (`num_fused` is then their count). Idempotent for a parameter already sharded the same way (tied weights are
    visited twice).
    """
    tp_size, tp_rank = dist.get_world_size(group), dist.get_rank(group)
    existing = get_tp_info(param)
    if existing is not None:
        if ((existing.dim % param.dim()) != (dim % param.dim()) or existing.num_fused != num_fused
                or existing.replicas != replicas):
            raise RuntimeError(f"parameter of shape {tuple(param.shape)} is shared by two modules that "
                               f"need different tensor-parallel layouts ({existing} vs dim={dim}); "
                               "untie them or replicate one of the modules")
        return param
    dim = dim % param.dim()
    full_shape = tuple(param.shape)
    size = full_shape[dim]
    shards = tp_size // replicas
    if blocks:
        num_fused = len(blocks)
        if sum(blocks) != size or any(b % shards for b in blocks):
            raise ValueError(f"dim {dim} of size {size}: blocks {blocks} do not each split into {shards} shards")
    if replicas < 1 or tp_size % replicas:
        raise ValueError(f"replicas={replicas} must divide tp_size={tp_size}")
    multiple = pad_to_multiple * shards if pad_to_multiple > 1 else shards
    padded = -(-size // multiple) * multiple if pad_to_multiple > 1 else size
    if num_fused > 1 and not blocks and size % (num_fused * shards):
        raise ValueError(f"fused dim of size {size} is not divisible into {num_fused} blocks x {shards} shards")
    if padded % shards:
        raise ValueError(f"dim {dim} of size {size} is not divisible into {shards} shards (tp_size={tp_size})")
    info = TensorParallelInfo(dim=dim, full_shape=full_shape, padded_size=padded, tp_rank=tp_rank,
                              tp_size=tp_size, num_fused=num_fused, group=group, replicas=replicas,
                              block_sizes=tuple(blocks))
    with torch.no_grad():
        set_data_(param, shard_tensor(param.data, info))
    set_tp_info(param, info)
    if replicas > 1 and param.requires_grad:
        register_grad_hook(param, partial(_sum_over_replicas, info))
    return param


def _sum_over_replicas(info: TensorParallelInfo, grad: torch.Tensor) -> torch.Tensor:
    """The gradient of a shard held by `replicas` ranks, each of which saw part of its use: the sum
    over them (one all-reduce over tp of a [num_shards, ...] buffer, this rank's slot filled)."""
    slots = grad.new_zeros((info.num_shards, *grad.shape))
    slots[info.shard_index] = grad
    comm.all_reduce(slots, info.group)
    return slots[info.shard_index]


@dataclass
class Adapter:
    """A low-rank adapter (peft LoRA, see shardformer/lora.py) computed inside a parallel linear on
    this rank's slice, so that it shares the linear's collectives. active(): whether it adds anything
    now (not disabled, not merged into the weight). compute(x): its product. draws_dropout(): whether
    it masks its input now. stream: the model's TPRankRNG once installed (a row adapter masks this
    rank's slice of the features from it)."""

    active: Callable[[], bool]
    compute: Callable[[torch.Tensor], torch.Tensor]
    draws_dropout: Callable[[], bool]
    stream: object = None


class _ParallelLinearBase(nn.Module):
    """Holds the native module's parameters and knows the weight layout."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, group, conv1d: bool):
        super().__init__()
        self.weight = weight
        self.bias = bias
        self.process_group = group
        self.conv1d = conv1d
        self.adapter: Adapter | None = None
        # float8 training (shardformer/float8.py): product(x, weight [out, in], bias) in place of F.linear
        self.product: Callable | None = None
        out_dim = 1 if conv1d else 0
        self.out_features = weight.shape[out_dim]
        self.in_features = weight.shape[1 - out_dim]

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.weight.t() if self.conv1d else self.weight
        return F.linear(x, weight, bias) if self.product is None else self.product(x, weight, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local), "
                f"bias={self.bias is not None}, conv1d={self.conv1d}")


def _enter_parallel_region(x: torch.Tensor, group, seq_parallel: bool) -> torch.Tensor:
    """The input of a column-parallel block: Megatron's f, or under sequence parallelism the
    sequence all-gathered (gradient reduce-scattered)."""
    if not seq_parallel:
        return comm.copy_to_tp(x, group)
    _check_sequence_layout(x)
    return comm.gather_from_seq(x, group, dim=1)


class _ColumnLinear(torch.autograd.Function):
    """A column-parallel linear with its own input collective, fused so that backward overlaps it:
    forward y = x W^T + b (x all-gathered along the sequence first under sequence parallelism);
    backward computes the input gradient, starts its all-reduce (reduce-scatter under sequence
    parallelism) asynchronously, computes the weight and bias gradients while it runs, and waits
    only then. The same products as autograd's, in the same dtype; the same bytes as Megatron's f."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, seq_parallel: bool, conv1d: bool):
        full = comm.all_gather(x, group, dim=1) if seq_parallel else x
        ctx.save_for_backward(full, weight)
        ctx.group, ctx.seq_parallel, ctx.conv1d, ctx.has_bias = group, seq_parallel, conv1d, bias is not None
        return F.linear(full, weight.t() if conv1d else weight, bias)

    @staticmethod
    def backward(ctx, grad):
        full, weight = ctx.saved_tensors
        w = weight.t() if ctx.conv1d else weight                        # [out, in]
        grad_input = grad.matmul(w) if ctx.needs_input_grad[0] else None
        pending = None
        if grad_input is not None:
            pending = comm.reduce_scatter_async(grad_input, ctx.group, dim=1) if ctx.seq_parallel \
                else comm.all_reduce_async(grad_input, ctx.group)
        flat_grad = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = flat_grad.t().matmul(full.reshape(-1, full.shape[-1]))        # [out, in]
            if ctx.conv1d:
                grad_weight = grad_weight.t()
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat_grad.sum(0)
        return (pending.wait() if pending is not None else None), grad_weight, grad_bias, None, None, None


def _check_sequence_layout(x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise SequenceLayoutError(
            f"sequence parallelism: a parallel linear got an input of shape {tuple(x.shape)}, not [batch, seq, "
            "features] (the model flattens or reshapes its hidden states inside a layer, as OPT's does before fc1), "
            "so its sequence cannot be found; use enable_sequence_parallelism=False for this model")


class ColumnParallelLinear(_ParallelLinearBase):
    """y = x A^T + b with A split by output features: each rank computes its slice of y.

    role (`regions.LinearRole`, from the sharder's plan): `applies_f`: apply Megatron's f (identity
    forward, all-reduce of the input grad backward); off when the block's input already passed
    through f once (several column-parallel linears reading the same input: q/k/v, gate/up), so the
    input grad is all-reduced once. `seq_parallel`: the input is this rank's chunk of the sequence
    (dim 1): with f, it is all-gathered along the sequence forward and its gradient reduce-scattered,
    in place of f (the same bytes). `region`: the enclosing block region, whose own input is not
    given f twice. The keywords `copy_input` / `seq_parallel` build a role for a layer used alone.
    gather_output: all-gather the output so every rank holds the full y.
    """

    def __init__(self, weight, bias, group, gather_output: bool = False, copy_input: bool = True,
                 conv1d: bool = False, seq_parallel: bool = False, role: LinearRole | None = None):
        super().__init__(weight, bias, group, conv1d)
        self.gather_output = gather_output
        self.role = role if role is not None else LinearRole(applies_f=copy_input, seq_parallel=seq_parallel)
        if self.role.region is not None:     # its weight gradient may hide the block's input collective
            self.role.region.add_column(self)

    @property
    def copy_input(self) -> bool:
        return self.role.applies_f

    @property
    def seq_parallel(self) -> bool:
        return self.role.seq_parallel

    @classmethod
    def from_native(cls, module: nn.Module, group, gather_output: bool = False, copy_input: bool = True,
                    num_fused: int = 1, replicas: int = 1, seq_parallel: bool = False,
                    role: LinearRole | None = None, blocks: tuple[int, ...] = ()) -> "ColumnParallelLinear":
        """replicas > 1: fewer output pieces than ranks (key/value heads fewer than tp), each held by
        `replicas` consecutive ranks (see `shard_parameter_`). blocks: unequal output segments, each split
        on its own. `role` replaces copy_input and seq_parallel."""
        conv1d = is_conv1d(module)
        out_dim = 1 if conv1d else 0
        shard_parameter_(module.weight, out_dim, group, num_fused=num_fused, replicas=replicas, blocks=blocks)
        if module.bias is not None:
            shard_parameter_(module.bias, 0, group, num_fused=num_fused, replicas=replicas, blocks=blocks)
        return cls(module.weight, module.bias, group, gather_output, copy_input, conv1d, seq_parallel, role)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        role = self.role
        enters = role.applies_f and not role.covered(x) and comm.is_parallel(self.process_group)
        if enters and role.seq_parallel:
            _check_sequence_layout(x)
        adapted = self.adapter is not None and self.adapter.active()
        if adapted or self.product is not None or is_nf4(self.weight):   # NF4: torchao's linear, dequantizing
            # one f (or sequence all-gather) for the base and the adapter: their input gradients are summed
            # by the same all-reduce; the base's product (a float8 one too) runs without the fused backward
            x = _enter_parallel_region(x, self.process_group, role.seq_parallel) if enters else x
            y = self._matmul(x, self.bias)
            y = y + self.adapter.compute(x).to(x.dtype) if adapted else y
        elif enters:
            y = _ColumnLinear.apply(x, self.weight, self.bias, self.process_group, role.seq_parallel, self.conv1d)
        else:
            y = self._block_product(x)
        if self.gather_output:
            y = comm.gather_from_tp(y, self.process_group, dim=-1)
            if role.region is not None:      # whole and equal on every rank: see BlockRegion._split_output
                role.region.note_gathered(y)
            return y
        if role.outputs is not None:         # this rank's slice of the features: see sharder.split_input_guard
            role.outputs.note(y)
        return y


    def _block_product(self, x: torch.Tensor) -> torch.Tensor:
        """The product on an input that already passed a collective: the block's own input (its weight
        gradient then computed while the block's collective runs, layers/overlap.py) or any other."""
        # Under torch.compile (regional compile, shardformer/compile.py) the plain product: the overlap's
        # per-call identity check on the block's region would become a per-layer guard (a recompile per
        # block); the block's input node then finds nothing deferred and autograd computes the weight grad.
        if torch.compiler.is_compiling() or self.product is not None or is_nf4(self.weight):  # torchao's backward
            return self._matmul(x, self.bias)
        deferred = self.role.region.deferred_for(x) if self.role.region is not None else None
        y = deferred_linear(x, self.weight, self.bias, deferred, self.conv1d) if deferred is not None else None
        return self._matmul(x, self.bias) if y is None else y


class RowParallelLinear(_ParallelLinearBase):
    """y = x A^T + b with A split by input features: partial products are summed by one
    all-reduce, then the (replicated) bias is added once.

    input_is_parallel: the input is already split along its last dim (the output of a
    column-parallel linear); otherwise this rank's slice is taken first.
    role.seq_parallel (or the `seq_parallel` keyword, for a layer used alone): the partial products
    are reduce-scattered along the sequence (dim 1) instead of all-reduced, so each rank keeps the
    sum for its chunk of the sequence (sequence parallelism; the bias, replicated, then sees only
    that chunk: its gradient is summed over tp, see sequence.py).
    """

    def __init__(self, weight, bias, group, input_is_parallel: bool = True, conv1d: bool = False,
                 seq_parallel: bool = False, role: LinearRole | None = None):
        super().__init__(weight, bias, group, conv1d)
        self.input_is_parallel = input_is_parallel
        self.role = role if role is not None else LinearRole(applies_f=False, seq_parallel=seq_parallel)

    @property
    def seq_parallel(self) -> bool:
        return self.role.seq_parallel

    @classmethod
    def from_native(cls, module: nn.Module, group, input_is_parallel: bool = True,
                    seq_parallel: bool = False, role: LinearRole | None = None) -> "RowParallelLinear":
        conv1d = is_conv1d(module)
        in_dim = 0 if conv1d else 1
        shard_parameter_(module.weight, in_dim, group)
        return cls(module.weight, module.bias, group, input_is_parallel, conv1d, seq_parallel, role)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.split_to_tp(x, self.process_group, dim=-1)
        partial_sums = self._matmul(x, None)
        if self.adapter is not None and self.adapter.active():      # joins the base's one reduction
            partial_sums = partial_sums + self._adapter_partial(x).to(partial_sums.dtype)
        if self.role.seq_parallel:
            _check_sequence_layout(partial_sums)
            y = comm.reduce_scatter_to_seq(partial_sums, self.process_group, dim=1)
        else:
            y = comm.reduce_from_tp(partial_sums, self.process_group)
        return y if self.bias is None else y + self.bias

    def _adapter_partial(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's product on this rank's input features (a partial sum), its dropout drawn
        from this rank's stream: the slices' masks are independent, as one process's mask is."""
        stream = self.adapter.stream if self.adapter.draws_dropout() else None
        if stream is None:
            return self.adapter.compute(x)
        stream.enter(x.device)
        try:
            return self.adapter.compute(x)
        finally:
            stream.leave()


class ColumnSubsetLinear(_ParallelLinearBase):
    """A column-parallel linear whose rank computes a chosen subset of the output features, some of
    which other ranks compute too: Falcon's fused [q | k | v] with one key/value head that all the
    ranks' query heads read. The weight stays whole on every rank (no shard record, so checkpoints
    and norms see a replicated weight); each rank multiplies by its `rows` only, and the weight's
    gradient (nonzero on its rows, partial on rows other ranks also use) is summed over tp as it is
    produced, so every rank holds the same, exact gradient of the whole weight. The input gradient
    is summed over tp by Megatron's f, as for any column-parallel linear."""

    def __init__(self, weight, bias, group, rows: torch.Tensor, seq_parallel: bool = False,
                 role: LinearRole | None = None):
        super().__init__(weight, bias, group, conv1d=False)
        self.role = role if role is not None else LinearRole(seq_parallel=seq_parallel)
        self.register_buffer("rows", rows, persistent=False)
        for p in (weight, bias):
            if p is not None and p.requires_grad:
                register_grad_hook(p, partial(sum_grad_over_tp, group))

    @property
    def seq_parallel(self) -> bool:
        return self.role.seq_parallel

    @classmethod
    def from_native(cls, module: nn.Module, group, rows: list[int], seq_parallel: bool = False,
                    role: LinearRole | None = None) -> "ColumnSubsetLinear":
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ColumnSubsetLinear needs nn.Linear, found {type(module).__name__}")
        return cls(module.weight, module.bias, group, torch.tensor(rows, dtype=torch.long,
                                                                   device=module.weight.device), seq_parallel, role)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.role.applies_f and not self.role.covered(x):
            x = _enter_parallel_region(x, self.process_group, self.role.seq_parallel)
        weight = self.weight.index_select(0, self.rows)
        bias = None if self.bias is None else self.bias.index_select(0, self.rows)
        y = F.linear(x, weight, bias)
        if self.role.outputs is not None:      # this rank's slice of the features: see sharder.split_input_guard
            self.role.outputs.note(y)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows={self.rows.numel()} of {self.out_features}"


def sum_grad_over_tp(group, grad: torch.Tensor) -> torch.Tensor:
    """A gradient hook for a weight every tp rank holds whole but uses only in part (its rows, its
    heads): the sum over tp is the gradient of the whole use."""
    grad = grad.contiguous()
    return comm.all_reduce(grad, group, out=torch.empty_like(grad))
