"""float8 training through torchao (ColossalAI's `use_fp8=True`): the model's linears swapped for
torchao's `Float8Linear` (`convert_to_float8_training`), whose matmuls run on float8 casts of their
inputs, weights and output gradients with dynamic scales (tensorwise: one per tensor; rowwise: one per
row), the weights themselves staying in the working precision.

Owns: `Float8Config` (the recipe and which linears) and `convert_float8`, which swaps the chosen linears
of a model for float8 ones (under tensor parallelism: gives each chosen column- or row-parallel linear a
`Float8Product`, whose casts use the whole tensor's scale: the amax of a sharded input, weight or output
gradient all-reduced (MAX) over the tp group by torchao's own `reduce_amax`, so every element is cast as
on one process), leaves the LM head and every linear whose dimensions torchao cannot
run in float8 (not multiples of 16) in high precision, listing the latter once, and, when FSDP2 shards the
weights (zero_stage=3), makes its all-gather move float8 (`enable_fsdp_float8_all_gather`), pointing the
user's optimizer at the weights torchao then wraps. On a device without float8 matmuls (CPU) torchao
emulates them (`emulate=True`: the same casts and scales, the products in high precision). Must not
implement float8 arithmetic itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshboost.shardformer.optimizations import say
from meshboost.shardformer.shard_config import switch_config

RECIPES = ("tensorwise", "rowwise")
# torchao's float8 matmul needs both dimensions of a weight to be multiples of this
FLOAT8_MULTIPLE = 16


@dataclass(frozen=True)
class Float8Config:
    """float8 training of the model's linears (torchao: `pip install torchao`, or the `fp8` extra from a clone)."""

    # "tensorwise": one scale per tensor (float8 all-gather under zero_stage=3); "rowwise": one per row
    recipe: str = "tensorwise"
    # which linears, as filter(module, fully-qualified name) -> bool; None: every nn.Linear but the LM head
    filter: Callable[[nn.Module, str], bool] | None = None
    # None: torchao's emulation where the device has no float8 matmul (CPU), real float8 on CUDA
    emulate: bool | None = None

    def __post_init__(self):
        if self.recipe not in RECIPES:
            raise ValueError(f"Float8Config(recipe={self.recipe!r}); expected one of {RECIPES}")
        if self.filter is not None and not callable(self.filter):
            raise TypeError(f"Float8Config(filter={self.filter!r}): pass a function (module, name) -> bool")
        if self.emulate not in (None, True, False):
            raise ValueError(f"Float8Config(emulate={self.emulate!r}); expected None, True or False")
        torchao_float8()            # a missing torchao is said when the config is built, before any collective

    @classmethod
    def of(cls, value) -> "Float8Config | None":
        """The config for the plugin's `float8=` / ColossalAI's `use_fp8=`: True, False / None, or a config."""
        return switch_config(cls, value, "float8")


def torchao_float8():
    """torchao's float8 training module, or an error saying how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ImportError("float8 training (use_fp8=True / Float8Config) runs on torchao's float8 linears, and torchao "
                          f"is not importable ({e}); install it with `pip install torchao` (or `pip install -e "
                          "'.[fp8]'` from a meshboost clone), or train without float8") from e
    return float8


def linear_config(config: Float8Config, device_type: str, fsdp_all_gather: bool):
    """torchao's `Float8LinearConfig` for `config` on `device_type`."""
    float8 = torchao_float8()
    base = float8.Float8LinearConfig.from_recipe_name(config.recipe)
    emulate = device_type != "cuda" if config.emulate is None else config.emulate
    return dataclasses.replace(base, emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather and config.recipe == "tensorwise")


@dataclass(frozen=True)
class _TPGroup:
    """What torchao's `reduce_amax` asks of a device mesh: the group its all-reduce runs over."""

    group: object

    def get_group(self):
        return self.group


@dataclass(frozen=True)
class Float8Product:
    """The tensorwise float8 product of a tensor-parallel linear, as torchao's `Float8Linear` computes it
    on the whole tensors: input and weight cast to float8 before torchao's matmul, each with the scale of
    the whole tensor (the amax all-reduced over the tp group where this rank holds a shard: the weight
    always, the input of a row-parallel linear), and, for a column-parallel linear, whose output
    features are split, the output gradient cast the same way before torchao's backward reads it. A
    replicated piece's own amax is the whole one's. Already-cast arguments are taken as they are by
    torchao's matmul (its `tensor_already_casted_to_fp8`); tensorwise casts serve forward and backward."""

    config: object               # torchao's Float8LinearConfig
    mm_config: object            # torchao's LinearMMConfig, from a Float8Linear built on meta
    group: _TPGroup
    input_sharded: bool
    output_sharded: bool

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        c = self.config
        x8 = _cast(x, c.cast_config_input.target_dtype, self, "INPUT", self.input_sharded)
        w8 = _cast(weight, c.cast_config_weight.target_dtype, self, "WEIGHT", True)
        y = matmul_with_hp_or_float8_args.apply(x8, w8.t(), self.mm_config, c)
        if self.output_sharded:
            y = _GradOutputToFloat8.apply(y, self)
        return y if bias is None else y + bias.to(y.dtype)


def _cast(t: torch.Tensor, dtype, product: Float8Product, role: str, sharded: bool):
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole
    return hp_tensor_to_float8_dynamic(t, dtype, product.mm_config, reduce_amax=sharded,
                                       gemm_input_role=GemmInputRole[role], device_mesh=product.group,
                                       round_scales_to_power_of_2=product.config.round_scales_to_power_of_2)


class _GradOutputToFloat8(torch.autograd.Function):
    """Forward: identity. Backward: the output gradient of a column-parallel float8 product (this rank's
    slice of the features) cast with the whole gradient's scale, for torchao's backward to use as is."""

    @staticmethod
    def forward(ctx, y, product):
        ctx.product = product
        return y

    @staticmethod
    def backward(ctx, grad):
        p = ctx.product
        return _cast(grad, p.config.cast_config_grad_output.target_dtype, p, "GRAD_OUTPUT", True), None


def _tensor_parallel_products(model: nn.Module, chosen: Callable, config) -> int:
    """Give each chosen column- or row-parallel linear of `model` its Float8Product; returns how many."""
    from meshboost.shardformer.layers.linear import ColumnParallelLinear, RowParallelLinear
    torchao_float8()
    from torchao.float8.float8_linear import Float8Linear
    mm_config = Float8Linear(16, 16, bias=False, device="meta", config=config).linear_mm_config
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and chosen(module, name):
            row = isinstance(module, RowParallelLinear)
            # a column-parallel output is this rank's features (gathered after the product, if at all)
            module.product = Float8Product(config, mm_config, _TPGroup(module.process_group), input_sharded=row,
                                           output_sharded=not row)
            count += 1
    return count


def convert_float8(model: nn.Module, config: Float8Config, device_type: str, fsdp_all_gather: bool = False,
                   optimizer=None) -> list[str]:
    """Swap the chosen linears of `model` (in place) for torchao's float8 ones; returns the names of those
    left in high precision because torchao cannot run their dimensions in float8 (logged once)."""
    float8 = torchao_float8()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    left: list[str] = []

    def chosen(module: nn.Module, name: str) -> bool:
        skipped = module is head if config.filter is None else not config.filter(module, name)
        if skipped:
            return False
        if module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE:
            left.append(f"{name} ({module.in_features}->{module.out_features})")
            return False
        return True

    before = dict(model.named_parameters())
    torchao_config = linear_config(config, device_type, fsdp_all_gather)
    _tensor_parallel_products(model, chosen, torchao_config)       # sharded linears (tp > 1): none at tp=1
    float8.convert_to_float8_training(model, module_filter_fn=chosen, config=torchao_config)
    if left:
        say("meshboost: float8: %d linear(s) stay in high precision, their dimensions not multiples of %d: %s",
            len(left), FLOAT8_MULTIPLE, ", ".join(left))
    if optimizer is not None:        # float8 all-gather wraps the weights in new parameters: point the optimizer at them
        moved = {id(p): q for name, q in model.named_parameters() if (p := before.get(name)) is not None and p is not q}
        for group in optimizer.param_groups:
            group["params"] = [moved.get(id(p), p) for p in group["params"]]
        for old_id, new in moved.items():
            old = next((p for p in optimizer.state if id(p) == old_id), None)
            if old is not None:
                optimizer.state[new] = optimizer.state.pop(old)
    return left
