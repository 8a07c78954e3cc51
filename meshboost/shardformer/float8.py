"""float8 training through torchao (ColossalAI's `use_fp8=True`): the model's linears swapped for
torchao's `Float8Linear` (`convert_to_float8_training`), whose matmuls run on float8 casts of their
inputs, weights and output gradients with dynamic scales (tensorwise: one per tensor; rowwise: one per
row), the weights themselves staying in the working precision.

Owns: `Float8Config` (the recipe and which linears), `ShardGroups` (the tp / cp groups a rank's
tensors are split over) and `convert_float8`, which swaps the chosen linears of a model for float8 ones:
torchao's own swap on one process or over dp / pp; under tensor parallelism each chosen column- or
row-parallel linear gets a `Float8Product` (float8_parallel.py: every cast uses the whole tensor's scale,
its amax agreed over the ranks holding the other pieces along the scale's axis); under context
parallelism every chosen plain linear becomes a `ScaledFloat8Linear` (token amaxes agreed over cp). It
leaves the LM head and every linear whose dimensions (under tp: this rank's shard's) torchao cannot run
in float8 (not multiples of 16) in high precision, listing the latter once, and, when FSDP2 shards the
weights (zero_stage=3, tensorwise), makes its all-gather move float8 (`enable_fsdp_float8_all_gather`;
under tp with the whole weight's scale), pointing the user's optimizer at the weights torchao then wraps.
On a device without float8 matmuls (CPU) torchao emulates them (`emulate=True`: the same casts and
scales, the products in high precision). Must not implement float8 arithmetic itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

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
class ShardGroups:
    """The groups a rank's tensors are split over, for float8's amaxes: tp (the features of the parallel
    linears), cp (the tokens, context parallelism); never both (HybridParallelConfig refuses float8 with
    tp_size > 1 and cp_size > 1)."""

    tp: object = None
    cp: object = None
    # ZeRO-3 under tp: the ranks holding the dp and tp pieces of a weight (its whole amax for FSDP2's float8 all-gather)
    weights: object = None

    def over(self, axes: frozenset):
        """The group an amax along dims split over `axes` ({"tp"}, {"cp"}, or none: None) is agreed over."""
        if not axes:
            return None
        group = getattr(self, next(iter(axes))) if len(axes) == 1 else None
        if group is None:
            raise ValueError(f"float8: an amax must be agreed over {sorted(axes)} and no group was given for it")
        return group


def _sharded_products(model: nn.Module, chosen: Callable, config, groups: ShardGroups) -> None:
    """Give each chosen column- or row-parallel linear of `model` its Float8Product and, under context
    parallelism (groups.cp: every linear is fed this rank's part of the tokens), swap each chosen plain
    linear for a ScaledFloat8Linear; without it torchao converts the plain ones itself."""
    from meshboost.distributed.param_info import get_tp_info
    from meshboost.shardformer.float8_parallel import (Float8Product, ScaledFloat8Linear, SharedShard,
                                                       gather_weights_in_float8)
    from meshboost.shardformer.layers.linear import ColumnParallelLinear, RowParallelLinear
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_linear_utils import swap_linear_layers
    mm_config = Float8Linear(16, 16, bias=False, device="meta", config=config).linear_mm_config
    tokens_split = groups.cp is not None
    parallel = []
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and chosen(module, name):
            row = isinstance(module, RowParallelLinear)
            # a column-parallel output is this rank's features (gathered after the product, if at all); under
            # sequence parallelism its input is gathered (and a row's output reduce-scattered) around the
            # product, so the product's tokens are whole
            own = dataclasses.replace(groups, tp=module.process_group)
            # key/value heads fewer than tp ranks: a column's output shard held by several ranks
            shared = None if row else SharedShard.of(get_tp_info(module.weight))
            module.product = Float8Product.build(config, mm_config, own, row=row, column=not row,
                                                 tokens_split=tokens_split, shared=shared)
            parallel.append(module)
    if parallel and config.enable_fsdp_float8_all_gather:         # ZeRO-3, tensorwise
        model.register_forward_pre_hook(gather_weights_in_float8(parallel, config, mm_config, groups.weights))
    if not tokens_split:
        torchao_float8().convert_to_float8_training(model, module_filter_fn=chosen, config=config)
        return

    def scaled(linear: nn.Linear) -> nn.Module:
        new = ScaledFloat8Linear.from_float(linear, config=config)    # torchao's float8 all-gather wrapper too
        new.product = Float8Product.build(config, mm_config, groups, tokens_split=True)
        return new

    swap_linear_layers(model, scaled, module_filter_fn=lambda m, n: type(m) is nn.Linear and chosen(m, n))


def convert_float8(model: nn.Module, config: Float8Config, device_type: str, fsdp_all_gather: bool = False,
                   optimizer=None, groups: ShardGroups | None = None) -> list[str]:
    """Swap the chosen linears of `model` (in place) for torchao's float8 ones; returns the names of those
    left in high precision because torchao cannot run their dimensions in float8 (logged once). `groups`:
    the tp / cp groups this rank's pieces are split over (None: one process, or the parallel linears' own
    tp group); their amaxes are agreed over them."""
    torchao_float8()
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    left: list[str] = []
    groups = groups or ShardGroups()

    def chosen(module: nn.Module, name: str) -> bool:
        skipped = module is head if config.filter is None else not config.filter(module, name)
        if skipped:
            return False
        # a parallel linear's in/out_features are this rank's shard's: the dims its float8 matmul runs on
        if module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE:
            if not any(entry.startswith(f"{name} (") for entry in left):
                left.append(f"{name} ({module.in_features}->{module.out_features})")
            return False
        return True

    before = dict(model.named_parameters())
    torchao_config = linear_config(config, device_type, fsdp_all_gather)
    _sharded_products(model, chosen, torchao_config, groups)
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
