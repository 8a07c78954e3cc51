"""QLoRA: the frozen base weights of the LoRA-adapted linears stored as 4-bit NF4 (torchao's `NF4Tensor`).

Owns `QuantConfig`, which linears are quantized (the `base_layer` of every peft LoRA `Linear`: the weights the
adapters train against; nothing trainable), and the refusals that keep it exact. What is refused:
  - meta weights (LazyInitContext): there are no values to quantize yet;
  - a trainable base weight;
  - DoRA, which reads the base weight's norm;
  - GPT-2's Conv1D, whose product torchao's NF4 does not implement;
  - a weight whose block count the scale groups do not divide;
  - bitsandbytes' configs.
torchao quantizes each weight whole, on one process's values. The tensor-parallel split then cuts the quantized
bytes (`distributed/quantized.py`), so every layout computes with the same dequantized values, bitwise.
Why torchao: it runs on CPU and CUDA alike, its NF4 is a tensor subclass that FSDP2 shards (it all-gathers the
4-bit data and the scales), and its linear dequantizes one layer at a time in the forward and the backward.
bitsandbytes' 4-bit layers replace the module, and its CPU backend is partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass(frozen=True)
class QuantConfig:
    """How the frozen bases are quantized: NF4 in blocks of `block_size` elements, each block's absmax scale
    quantized again to int8 in groups of `scaler_block_size` scales (QLoRA's double quantization)."""

    kind: str = "nf4"
    block_size: int = 64
    scaler_block_size: int = 256

    def __post_init__(self):
        if self.kind != "nf4":
            raise ValueError(f"QuantConfig(kind={self.kind!r}): only 'nf4' (4-bit NormalFloat, QLoRA's) is supported")
        for name in ("block_size", "scaler_block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"QuantConfig({name}={value!r}) must be a positive integer")
        if self.block_size % 2:
            raise ValueError(f"QuantConfig(block_size={self.block_size}) must be even (two 4-bit codes per byte)")


def quant_config(quantize) -> QuantConfig | None:
    """`enable_lora(quantize=...)`'s value as a config: False/None -> None, True or "nf4" -> the defaults."""
    if quantize is None or quantize is False:
        return None
    if quantize is True or quantize == "nf4":
        return QuantConfig()
    if isinstance(quantize, QuantConfig):
        return quantize
    raise ValueError(f"enable_lora(quantize={quantize!r}): pass True, 'nf4' or a meshboost QuantConfig(...)")


def _targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, base linear) of every peft LoRA Linear layer."""
    found = []
    for name, module in model.named_modules():
        base = getattr(module, "base_layer", None)
        if base is not None and hasattr(module, "lora_A") and not isinstance(getattr(base, "base_layer", None),
                                                                             nn.Module):
            found.append((f"{name}.base_layer", base))
    return found


def check_quantizable(model: nn.Module, config: QuantConfig) -> list[tuple[str, nn.Module]]:
    """The base linears to quantize, or the first reason one cannot be, raised (pure: every rank alike)."""
    peft_config = getattr(model, "peft_config", {})
    if any(getattr(c, "use_dora", False) for c in peft_config.values()):
        raise NotImplementedError("enable_lora(quantize=...) with use_dora=True: DoRA reads the base weight's "
                                  "norm, which meshboost does not compute from NF4; use plain LoRA for QLoRA")
    targets = _targets(model)
    if not targets:
        raise ValueError("enable_lora(quantize=...): the LoRA config adapts no Linear layer, so no base weight "
                         "would be quantized; set target_modules to linear layers")
    for name, base in targets:
        weight = getattr(base, "weight", None)
        if type(base).__name__ == "Conv1D" or not isinstance(base, nn.Linear):
            raise NotImplementedError(f"enable_lora(quantize=...): {name} is a {type(base).__name__}, and torchao's "
                                      "NF4 implements nn.Linear's product only; leave it out of target_modules")
        if weight.is_meta:
            raise NotImplementedError(f"enable_lora(quantize=...): {name}.weight is on meta (LazyInitContext), "
                                      "so there is nothing to quantize yet; build the model eagerly for QLoRA")
        if weight.requires_grad:
            raise ValueError(f"enable_lora(quantize=...): {name}.weight is trainable; a quantized base must be "
                             "frozen (peft freezes it: do not set requires_grad on it afterwards)")
        blocks, rest = divmod(weight.numel(), config.block_size)
        if rest or blocks % config.scaler_block_size:
            raise ValueError(f"enable_lora(quantize=...): {name}.weight has {weight.numel()} elements, not a multiple "
                             f"of block_size={config.block_size} x scaler_block_size={config.scaler_block_size}; "
                             "pass QuantConfig(block_size=..., scaler_block_size=...) that divide it")
    return targets


def quantize_bases_(model: nn.Module, config: QuantConfig) -> int:
    """Replace each LoRA base linear's weight by its NF4 quantization (torchao's `to_nf4`), frozen, in place;
    returns how many were quantized."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    targets = check_quantizable(model, config)
    for _, base in targets:
        with torch.no_grad():
            quantized = to_nf4(base.weight.detach().contiguous(), config.block_size, config.scaler_block_size)
        base.weight = nn.Parameter(quantized, requires_grad=False)
    return len(targets)
