"""LoRA adapters (HuggingFace peft) sharded with the linear they adapt.

Owns: recognising a peft LoRA layer at a path the tensor-parallel plan names (checked by class
module, so peft is never imported here), refusing what cannot be sharded exactly (pure, before
anything is touched, so every rank raises alike), and, once the base linear is parallel, slicing the
adapters in place and handing the base the adapter's product so that it joins the base's own
collectives:

  column-parallel base (output features split): `lora_A` replicated, `lora_B` split like the base's
      output (fused blocks and key/value-head replicas included). The input passes Megatron's f once
      for both products (under sequence parallelism its all-gather), so its gradient through the
      adapter is summed with the base's; `lora_A`'s gradient (each rank holds the part from its
      output features) is summed over tp as it is produced.
  row-parallel base (input features split): `lora_A` split like the base's input, `lora_B`
      replicated. The adapter's partial output is added to the base's partial sums before their one
      all-reduce (or reduce-scatter), so no collective is added; `lora_B`'s gradient (computed from
      this rank's partial `lora_A` output) is summed over tp.

`lora_dropout` in a column adapter reads the input every tp rank holds, so it draws from the shared
stream (the same mask on every rank, as one process draws one mask); in a row adapter it reads this
rank's slice of the features and draws from this rank's stream (`rng.py`), whose state activation
checkpointing replays. The layer stays peft's own object (its class is swapped for a subclass whose
forward defers to the base), so `merge`, `unmerge`, `merge_and_unload`, `disable_adapter` and
`state_dict` names are peft's: merging adds `B @ A` shard by shard, which is the merged weight's
shard. Adapters on packed MoE experts (peft's `target_parameters`) are `lora_experts.py`'s; `adapter_base`
and `shard_adapter_` hand them over. Must not know a model family, nor shard anything the plan does not name.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn as nn

from meshboost.distributed.ownership import weak_method
from meshboost.distributed.param_info import get_tp_info, register_grad_hook
from meshboost.shardformer import lora_experts
from meshboost.shardformer.styles import EXPERT_STYLES
from meshboost.shardformer.layers.linear import (
    Adapter,
    ColumnParallelLinear,
    RowParallelLinear,
    shard_parameter_,
    sum_grad_over_tp,
)

COLUMN_STYLES = ("colwise", "colwise_fused", "colwise_heads", "colwise_gather")
ROW_STYLES = ("rowwise", "rowwise_split")


def is_peft_module(module: nn.Module) -> bool:
    """A module of peft's (a tuner layer, a modules_to_save wrapper)."""
    return any(c.__module__.startswith("peft.") for c in type(module).__mro__)


def transformers_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft model (what the plans, stages and checks read), else `model`."""
    if is_peft_module(model) and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def lora_dropout(model: nn.Module) -> float:
    """The largest lora_dropout probability of the peft LoRA layers in `model` (0.0 without any)."""
    return max((d.p for m in model.modules() if is_lora_linear(m) for d in m.lora_dropout.values()
                if isinstance(d, nn.Dropout)), default=0.0)


def is_lora_linear(module: nn.Module) -> bool:
    """peft's LoRA layer around a linear (`peft.tuners.lora.Linear`), not one of its variants' classes."""
    return any(c.__module__.startswith("peft.tuners.lora") and c.__name__ == "Linear" for c in type(module).__mro__)


def adapter_linears(layer: nn.Module) -> list[nn.Module]:
    """The adapter's own modules (every lora_A / lora_B linear), which the plan covers with the base."""
    return [m for d in (layer.lora_A, layer.lora_B) for m in d.values()]


def adapter_base(path: str, module: nn.Module, style: str, shard_config) -> tuple[list, str, nn.Module]:
    """(the peft layers wrapping the module the plan names at `path`, checked (pure) for `shard_config`;
    the path suffix to the module they wrap, which the plan's `style` shards; that module)."""
    if lora_experts.is_expert_adapter(module):
        wrappers, suffix, base = lora_experts.unwrap(module)
        if style not in EXPERT_STYLES:
            raise NotImplementedError(
                f"{path}: peft's target_parameters adapts {[w.parameter_name for w in wrappers]} of a module the "
                f"plan shards with style {style!r}; adapters on parameters are split on packed MoE experts only: "
                "use target_modules for this module, or tp_size=1")
        lora_experts.check_wrappers(path, wrappers, base)
        return wrappers, suffix, base
    check_adapter(path, module, style, shard_config.enable_sequence_parallelism)
    return [module], ".base_layer", module.base_layer


def check_adapter(path: str, layer: nn.Module, style: str, sequence_parallel: bool) -> None:
    """Raise (pure) unless the LoRA `layer` at `path`, whose base the plan gives `style`, can be
    sharded exactly."""
    if not is_lora_linear(layer):
        raise NotImplementedError(
            f"{path}: peft's {type(layer).__name__} (an adapter kind, or modules_to_save, on a module tensor "
            "parallelism splits) cannot be sharded by meshboost; leave this module out of target_modules / "
            "modules_to_save (LoRA on the column- and row-parallel linears is supported), or use tp_size=1")
    if style not in COLUMN_STYLES + ROW_STYLES:
        raise NotImplementedError(
            f"{path}: a LoRA adapter on a linear the plan shards with style {style!r} cannot be sharded exactly; "
            f"adapters are sharded on {', '.join(COLUMN_STYLES + ROW_STYLES)} linears: leave {path.rsplit('.', 1)[-1]!r} "
            "out of target_modules, or use tp_size=1")
    for name in layer.lora_A:
        reasons = []
        if getattr(layer, "lora_variant", {}).get(name) is not None:
            reasons.append(f"the {type(layer.lora_variant[name]).__name__} variant (use_dora, ...)")
        if getattr(layer, "lora_bias", {}).get(name):
            reasons.append("lora_bias=True")
        if not isinstance(layer.lora_A[name], nn.Linear) or not isinstance(layer.lora_B[name], nn.Linear):
            reasons.append("adapter modules other than nn.Linear")
        if reasons:
            raise NotImplementedError(f"{path}: adapter {name!r} uses {' and '.join(reasons)}, which meshboost does "
                                      "not shard under tensor parallelism; use plain LoRA, or tp_size=1")
        dropout = layer.lora_dropout[name]
        if sequence_parallel and style in COLUMN_STYLES and isinstance(dropout, nn.Dropout) and dropout.p > 0:
            raise NotImplementedError(
                f"{path}: lora_dropout={dropout.p} on a column-parallel linear under sequence parallelism: its input "
                "is the gathered sequence, which every tp rank must mask alike, while the layer draws from this "
                "rank's stream; use lora_dropout=0.0, or enable_sequence_parallelism=False")


class _ParallelLora:
    """Mixed in front of peft's LoRA Linear once its base is parallel: the base computes the adapter's
    product inside its own forward (`tp_adapter`), so this forward only routes."""

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        if kwargs.pop("adapter_names", None) is not None:
            raise NotImplementedError("peft's mixed-batch adapter_names= is not supported on tensor-parallel LoRA "
                                      "layers; activate one adapter set with set_adapter")
        if self.disable_adapters and self.merged:
            self.unmerge()
        return self.base_layer(x, *args, **kwargs)

    def tp_active(self) -> bool:
        """Whether an adapter adds to the base now (not disabled, not merged into its weight)."""
        return not (self.disable_adapters or self.merged) and any(n in self.lora_A for n in self.active_adapters)

    def tp_adapter(self, x: torch.Tensor) -> torch.Tensor:
        """The active adapters' sum, B(A(dropout(x))) x scaling, on this rank's slice."""
        out = None
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            h = lora_B(lora_A(self.lora_dropout[name](x.to(lora_A.weight.dtype)))) * self.scaling[name]
            out = h if out is None else out + h
        return out

    def tp_dropout_active(self) -> bool:
        return self.training and any(isinstance(self.lora_dropout[n], nn.Dropout) and self.lora_dropout[n].p > 0
                                     for n in self.active_adapters if n in self.lora_dropout)


_CLASSES: dict[type, type] = {}


def _parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (_ParallelLora, cls), {"__module__": __name__})
    return _CLASSES[cls]


def shard_adapter_(layer: nn.Module, group) -> None:
    """Slice the adapters of `layer` (whose `base_layer` is now a parallel linear) in place and
    wire them into the base's forward (a wrapper of packed experts: split with its experts)."""
    if lora_experts.is_expert_adapter(layer):
        lora_experts.shard_tp_(layer, group)
        return
    base = layer.base_layer
    if isinstance(base, ColumnParallelLinear):
        info = get_tp_info(base.weight)
        for name in layer.lora_B:
            shard_parameter_(layer.lora_B[name].weight, 0, group, num_fused=info.num_fused, replicas=info.replicas)
            weight = layer.lora_A[name].weight
            if weight.requires_grad:
                register_grad_hook(weight, partial(sum_grad_over_tp, group))
    elif isinstance(base, RowParallelLinear):
        for name in layer.lora_A:
            shard_parameter_(layer.lora_A[name].weight, 1, group)
            weight = layer.lora_B[name].weight
            if weight.requires_grad:
                register_grad_hook(weight, partial(sum_grad_over_tp, group))
    else:
        raise TypeError(f"LoRA base {type(base).__name__} is not a column- or row-parallel linear")
    layer.__class__ = _parallel_class(type(layer))
    # the base is the layer's child: weak methods, so the pair is no reference cycle (freed when dropped);
    # a base outliving its layer (peft's unload) sees an inactive adapter
    base.adapter = Adapter(weak_method(layer.tp_active), weak_method(layer.tp_adapter),
                           weak_method(layer.tp_dropout_active))
