"""What a weight export sends: one `ExportEntry` per tensor the consumer loads, under the name it loads it by.

Owns: the entries of a plain model (`checkpoint_entries`: the names and tensors `save_model` writes), and of a
peft LoRA model, on request: merged (each adapted linear's weight as peft's `merge_and_unload` gives it,
base + delta by peft's own `get_delta_weight`, computed on the gathered tensors: the training model is never
touched; base names, as the base model's HF checkpoint) or as adapters (the adapter tensors under the names
peft's `save_pretrained` writes). Each entry lists the live tensors of this rank it is made of, gathered in
that order by the exporter (`export.py`), and how their full values make the exported one. Must not
communicate.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch
import torch.nn as nn

from meshboost.checkpoint.model_io import checkpoint_entries
from meshboost.distributed.param_info import full_shape, is_dtensor

MERGED, ADAPTERS = "merged", "adapters"


@dataclass
class ExportEntry:
    name: str                                   # the name the consumer loads it by
    sources: list[torch.Tensor]                 # this rank's live tensors it is made of, gathered in order
    shape: tuple[int, ...]                      # the full shape of the exported tensor
    dtype: torch.dtype                          # the dtype the live tensor holds
    combine: Callable[[list[torch.Tensor]], torch.Tensor] | None = None   # full sources -> exported value

    def out_dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """The exported dtype: `dtype` for floating-point tensors when given, else the live tensor's."""
        return dtype if dtype is not None and self.dtype.is_floating_point else self.dtype

    def value(self, fulls: list[torch.Tensor], dtype: torch.dtype | None) -> torch.Tensor:
        """The exported tensor from the full sources (each cast to the exported dtype first, as a model
        loaded in that dtype would hold them)."""
        out = self.out_dtype(dtype)
        fulls = [f.to(out) if f.is_floating_point() else f for f in fulls]
        return fulls[0] if self.combine is None else self.combine(fulls)


def local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own values of a live tensor (FSDP2: its DTensor's local shard)."""
    tensor = tensor.detach()
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _entry(name: str, tensor: torch.Tensor, sources=None, combine=None) -> ExportEntry:
    return ExportEntry(name, sources or [tensor], full_shape(tensor), tensor.dtype, combine)


def is_peft_model(model: nn.Module) -> bool:
    return any(c.__module__.startswith("peft.") for c in type(model).__mro__)


def entries_of(model: nn.Module, lora: str = MERGED, rename: Callable[[str], str | None] | None = None
               ) -> list[ExportEntry]:
    """The entries of `model` on this rank (its stage's), in state-dict order. A peft model: `lora` is
    MERGED (names through `rename`: the base model's HF name, None for a tensor the base lacks) or
    ADAPTERS; a plain model's are `save_model`'s."""
    if lora not in (MERGED, ADAPTERS):
        raise ValueError(f"lora={lora!r} must be {MERGED!r} (adapted weights merged into the base model's) or "
                         f"{ADAPTERS!r} (the LoRA tensors only, peft's names)")
    if not is_peft_model(model):
        if lora == ADAPTERS:
            raise ValueError(f"lora='adapters': {type(model).__name__} has no LoRA adapters; drop lora= to export "
                             "the whole model")
        return [_entry(name, t) for name, t in checkpoint_entries(model).items()]
    if lora == ADAPTERS:
        return _adapter_entries(model)
    return _merged_entries(model, rename or (lambda name: name))


def _adapter_entries(model: nn.Module) -> list[ExportEntry]:
    """The adapter tensors (trainable peft tensors) under peft's saved names (adapter name dropped)."""
    from peft.utils import get_peft_model_state_dict
    mine = {name: t for name, t in checkpoint_entries(model).items() if getattr(t, "requires_grad", False)}
    # peft picks and renames; it is handed meta stand-ins of the same shapes, so that it neither gathers a
    # DTensor (peft >= 0.22 makes FSDP2's shards full CPU copies) nor hands back other objects than it was given
    stand_ins = {name: torch.empty(tuple(t.shape), device="meta") for name, t in mine.items()}
    saved = get_peft_model_state_dict(model, state_dict=stand_ins)
    by_id = {id(t): name for name, t in saved.items()}
    picked = [(by_id[id(stand_ins[name])], t) for name, t in mine.items() if id(stand_ins[name]) in by_id]
    if mine and not picked:
        raise RuntimeError(f"export_weights(lora='adapters'): peft picked none of the {len(mine)} trainable tensors "
                           "as adapters (a peft version whose get_peft_model_state_dict meshboost does not know)")
    return [_entry(name, t) for name, t in picked]


def _lora_layers(model: nn.Module) -> dict[int, tuple[nn.Module, str]]:
    """id(base weight) -> (its peft LoRA layer, the active adapter), refusing what a merge cannot be
    computed for here (on every rank alike: the same model)."""
    import peft
    from peft.tuners.lora import LoraLayer
    config = next(iter(model.peft_config.values()))
    if len(model.peft_config) > 1:
        raise NotImplementedError(f"export_weights(lora='merged') merges one adapter; this model has "
                                  f"{sorted(model.peft_config)}: delete_adapter the others first")
    if getattr(config, "modules_to_save", None):
        raise NotImplementedError(f"export_weights(lora='merged') with modules_to_save={config.modules_to_save}: "
                                  "the trained copies are not merged here; export lora='adapters' instead")
    layers = {}
    for name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        adapter = module.active_adapters[0]
        # peft's own class: meshboost's tensor-parallel LoRA is a subclass of it (shardformer/lora.py)
        own = next(c for c in type(module).__mro__ if c.__module__.startswith("peft."))
        if own is not peft.tuners.lora.Linear or module.use_dora.get(adapter) or \
                module.lora_bias.get(adapter):
            raise NotImplementedError(f"export_weights(lora='merged'): {name} is peft's {own.__name__} "
                                      "adapter (DoRA, a LoRA bias, or not on a linear layer); only plain LoRA on "
                                      "linears merges here: export lora='adapters' instead")
        layers[id(module.get_base_layer().weight)] = (module, adapter)
    return layers


def _merge(layer: nn.Module, adapter: str) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    from peft.tuners.lora import Linear

    def merged(fulls: list[torch.Tensor]) -> torch.Tensor:
        base, a, b = fulls
        # peft's own delta (B @ A, transposed for fan_in_fan_out, times the scaling) on the full factors
        factors = SimpleNamespace(lora_A={adapter: SimpleNamespace(weight=a)},
                                  lora_B={adapter: SimpleNamespace(weight=b)},
                                  fan_in_fan_out=layer.fan_in_fan_out, scaling=layer.scaling)
        delta = Linear.get_delta_weight(factors, adapter)
        return base + delta.to(base.dtype)      # peft's merge: weight += delta.to(weight's dtype)
    return merged


def _merged_entries(model: nn.Module, rename: Callable[[str], str | None]) -> list[ExportEntry]:
    layers = _lora_layers(model)
    factors = {id(layer.lora_A[a].weight) for layer, a in layers.values()} | \
        {id(layer.lora_B[a].weight) for layer, a in layers.values()}
    out = []
    for name, tensor in checkpoint_entries(model).items():
        target = rename(name)
        if target is None or id(tensor) in factors:      # an adapter tensor: folded into its base weight
            continue
        if id(tensor) in layers:
            layer, adapter = layers[id(tensor)]
            sources = [tensor, layer.lora_A[adapter].weight, layer.lora_B[adapter].weight]
            out.append(_entry(target, tensor, sources, _merge(layer, adapter)))
        else:
            out.append(_entry(target, tensor))
    return out
