"""float8 products on sharded tensors: the scales torchao's `Float8Linear` would compute on one process,
when this rank holds only a piece of an input, weight or output gradient.

Owns: `Float8Product`, the float8 product a tensor-parallel linear (shardformer/layers/linear.py, its
`product`) or a linear fed this rank's part of the sequence under context parallelism (`ScaledFloat8Linear`)
computes in place of `F.linear` (over float8.py's `ShardGroups`), and, under ZeRO-3, the whole weight's
scale for FSDP2's float8 all-gather of a tensor-parallel weight (`gather_weights_in_float8`). Every
float8 cast of torchao's three products (forward; input gradient; weight gradient) takes its amax along
some dims of its operand (tensorwise: all of them; rowwise: along one, a scale per row or per column);
where one of those dims is split over ranks (features over tp, tokens over cp), the amax is all-reduced
(MAX) over those ranks by torchao's own `reduce_amax`, so every element is cast with the scale one
process would use. A dim split over no rank needs nothing: each rank's rows are whole. A column whose
output shard several tp ranks hold (key/value heads fewer than tp ranks) gets on each of them only its
own query heads' part of that shard's output gradient; torchao casts the whole one (their sum), so the
backward first sums it over the holders (`SharedShard`) and one holder alone returns the shard's
gradients (the others' zeros join the sums that follow: the replicas' weight-gradient hook, the input
gradient's all-reduce), which are then the gradients one process computes.

Imports torchao: float8.py loads it only when a model is converted. Must not implement float8
arithmetic: the casts, scales and matmuls are torchao's (`hp_tensor_to_float8_dynamic`, its float8
tensor's `mm`); this file only says over which ranks each amax is taken, and runs torchao's three
products in its order (`matmul_with_hp_or_float8_args`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchao.float8.config import ScalingGranularity, ScalingType
from torchao.float8.distributed_utils import tensor_already_casted_to_fp8
from torchao.float8.float8_linear import Float8Linear
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import GemmInputRole
from torchao.float8.float8_utils import amax_to_scale
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from meshboost.distributed import comm


# torchao's six casts (its Float8LinearConfig's `cast_config_<name>`): the operand each casts and the dim
# its rowwise scale is taken along (torchao's `get_maybe_axiswise_dim` arguments in its matmul). Operands:
# input [tokens, in], weight_t [in, out] (the transposed weight), grad_output [tokens, out].
CASTS = {
    "input": ("input", -1),                              # forward: a scale per token
    "weight": ("weight_t", 0),                           # forward: a scale per output feature
    "grad_output": ("grad_output", -1),                  # input gradient: a scale per token
    "weight_for_grad_input": ("weight_t", -1),           # input gradient: a scale per input feature
    "grad_output_for_grad_weight": ("grad_output", 0),   # weight gradient: a scale per output feature
    "input_for_grad_weight": ("input", 0),               # weight gradient: a scale per input feature
}


@dataclass(frozen=True)
class _Group:
    """What torchao's `reduce_amax` asks of a device mesh: the group its all-reduce runs over."""

    group: object

    def get_group(self):
        return self.group


@dataclass(frozen=True)
class SharedShard:
    """The output shard of a column-parallel linear held by `replicas` consecutive ranks of `group`
    (param_info's TensorParallelInfo: key/value heads fewer than tp ranks), each of which holds only
    its own heads' part of the shard's output gradient."""

    group: object
    num_shards: int
    shard_index: int
    leader: bool                 # the holder that returns the shard's gradients (the others return zeros)

    @classmethod
    def of(cls, info) -> "SharedShard | None":
        """From a column weight's TensorParallelInfo; None where every shard has one holder."""
        if info is None or info.replicas == 1:
            return None
        return cls(info.group, info.num_shards, info.shard_index, info.tp_rank % info.replicas == 0)

    def whole(self, grad: torch.Tensor) -> torch.Tensor:
        """The shard's whole output gradient: the sum over its holders (one all-reduce over the group of a
        [num_shards, ...] buffer, this rank's slot filled, as the replicas' weight-gradient hook does)."""
        slots = grad.new_zeros((self.num_shards, *grad.shape))
        slots[self.shard_index] = grad
        comm.all_reduce(slots, self.group)
        return slots[self.shard_index]


@dataclass(frozen=True)
class Float8Product:
    """The float8 product of a linear whose operands this rank holds pieces of, equal element for element
    to torchao's `Float8Linear` on the whole tensors: `reductions` holds, per torchao cast (CASTS), the
    group its amax is agreed over (None: this rank's piece already holds whole rows for that scale)."""

    config: object               # torchao's Float8LinearConfig
    mm_config: object            # torchao's LinearMMConfig, from a Float8Linear built on meta
    reductions: tuple            # ((cast name, _Group | None), ...) in CASTS' order
    shared: SharedShard | None = None    # a column's output shard held by several tp ranks

    @classmethod
    def build(cls, config, mm_config, groups, row: bool = False, column: bool = False,
              tokens_split: bool = False, shared: SharedShard | None = None) -> "Float8Product":
        """groups: float8.py's ShardGroups (not imported: float8.py loads this file). row: the input
        features (and weight columns) are split over tp; column: the output features (weight rows, output
        gradient columns); tokens_split: the tokens, over cp; shared: a column's output shard held by
        several tp ranks (`SharedShard.of` its weight's record)."""
        tp_in, tp_out, seq = ("tp" if row else None), ("tp" if column else None), ("cp" if tokens_split else None)
        split = {"input": (seq, tp_in), "weight_t": (tp_in, tp_out), "grad_output": (seq, tp_out)}
        reductions = []
        for name, (operand, dim) in CASTS.items():
            granularity = getattr(config, f"cast_config_{name}").scaling_granularity
            along = split[operand] if granularity is ScalingGranularity.TENSORWISE else (split[operand][dim],)
            group = groups.over(frozenset(a for a in along if a is not None))
            reductions.append((name, None if group is None else _Group(group)))
        return cls(config, mm_config, tuple(reductions), shared)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ weight.T (+ bias), weight [out, in], as torchao's Float8Linear.forward computes it."""
        y = _Float8Matmul.apply(x, weight.t(), self)
        return y if bias is None else y + bias.to(y.dtype)

    def cast(self, t: torch.Tensor, name: str):
        """`t` cast to float8 as torchao's cast `name` does, its amax agreed over that cast's group."""
        cast_config = getattr(self.config, f"cast_config_{name}")
        if tensor_already_casted_to_fp8(t) or cast_config.scaling_type is ScalingType.DISABLED:
            return t               # a weight FSDP2 gathered in float8 (tensorwise), or a cast torchao skips
        operand, dim = CASTS[name]
        group = dict(self.reductions)[name]
        role = {"input": "INPUT", "weight_t": "WEIGHT", "grad_output": "GRAD_OUTPUT"}[operand]
        axiswise = cast_config.scaling_granularity is ScalingGranularity.AXISWISE
        return hp_tensor_to_float8_dynamic(t, cast_config.target_dtype, self.mm_config, reduce_amax=group is not None,
                                           gemm_input_role=GemmInputRole[role], device_mesh=group,
                                           scaling_granularity=cast_config.scaling_granularity,
                                           axiswise_dim=dim if axiswise else None,
                                           round_scales_to_power_of_2=self.config.round_scales_to_power_of_2)


class _Float8Matmul(torch.autograd.Function):
    """torchao's three float8 products of a linear (its `matmul_with_hp_or_float8_args`, in its order and
    shapes), each cast by `Float8Product.cast`: the high-precision operands are saved and cast again for
    the backward products, along the dims their rowwise scales need there. A shared output shard's
    gradient is summed over its holders before it is cast (torchao casts the whole)."""

    @staticmethod
    def forward(ctx, x, weight_t, product: Float8Product):
        ctx.save_for_backward(x, weight_t)
        ctx.product = product
        x8 = product.cast(x, "input")
        y = torch.mm(x8.reshape(-1, x8.shape[-1]), product.cast(weight_t, "weight"))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        x, weight_t = ctx.saved_tensors
        p = ctx.product
        g = grad.reshape(-1, grad.shape[-1])
        if p.shared is not None:
            g = p.shared.whole(g)
        grad_input = torch.mm(p.cast(g, "grad_output"), p.cast(weight_t, "weight_for_grad_input").t())
        grad_input = grad_input.reshape(*grad.shape[:-1], grad_input.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        grad_weight = torch.mm(p.cast(g, "grad_output_for_grad_weight").t(), p.cast(x2, "input_for_grad_weight"))
        if p.shared is not None and not p.shared.leader:
            # every holder ran the casts (their amaxes are agreed over tp); one returns the shard's
            # gradients, the others zeros, which join the sums that follow exactly
            grad_input, grad_weight = torch.zeros_like(grad_input), torch.zeros_like(grad_weight)
        return grad_input, grad_weight.t(), None


class ScaledFloat8Linear(Float8Linear):
    """torchao's `Float8Linear` computing through a `Float8Product` (a linear fed this rank's part of the
    sequence, whose casts agree their amaxes over the ranks holding the other tokens). Built by torchao's
    own `from_float`, so under FSDP2 its weight is torchao's float8 all-gather wrapper as any Float8Linear's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.product: Float8Product | None = None      # set by convert_float8 right after from_float

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x, self.weight, self.bias)


def gather_weights_in_float8(modules: list, config, mm_config, group) -> "WeightScales":
    """Make FSDP2 all-gather the weights of the tensor-parallel `modules` in float8 (ZeRO-3 under tp): each
    weight becomes torchao's float8 all-gather wrapper (its records carried over), cast by FSDP2 before
    the all-gather with the scale `WeightScales` (a forward pre-hook of the model, returned) sets, the
    whole weight's: its amax agreed over `group`, the ranks holding its dp and tp pieces. torchao's own
    wrapper would reduce over FSDP2's dp mesh only: one tp shard's scale."""
    from meshboost.distributed.param_info import attach_records, records_of
    for module in modules:
        old = module.weight
        wrapped = WeightWithDynamicFloat8CastTensor(old.data, mm_config, config.cast_config_weight.target_dtype)
        module.weight = torch.nn.Parameter(wrapped, requires_grad=old.requires_grad)
        attach_records(module.weight, records_of(old))
    return WeightScales(tuple(modules), group, config.cast_config_weight.target_dtype)


@dataclass(frozen=True)
class WeightScales:
    """Forward pre-hook of a model whose tensor-parallel float8 weights FSDP2 gathers in float8: before any
    unit all-gathers, each weight's scale from the amax of the whole weight (this rank's dp shard of its tp
    shard, MAX-reduced over every dp and tp rank in one all-reduce), handed to torchao's wrapper as the
    scale its pre-all-gather cast uses (`_precomputed_scale`, torchao's field for exactly this, which its
    `precompute_float8_dynamic_scale_for_fsdp` fills the same way over dp alone)."""

    modules: tuple
    group: object
    dtype: torch.dtype

    @torch.no_grad()
    def __call__(self, model, args):
        from meshboost.distributed import comm
        # the DTensor shard FSDP2 casts before its all-gather (to_local() may hand out another object)
        pieces = [getattr(m.weight, "_local_tensor", m.weight) for m in self.modules]
        amax = torch.stack([p._tensor.abs().max() if p.numel() else p._tensor.new_zeros(()) for p in pieces])
        comm.all_reduce(amax, self.group, op=torch.distributed.ReduceOp.MAX)
        for piece, scale in zip(pieces, amax_to_scale(amax, self.dtype)):
            piece._precomputed_scale = scale
