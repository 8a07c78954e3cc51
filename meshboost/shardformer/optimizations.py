"""The kernel switches of `ShardConfig` (issue 13): the attention kernel and fused normalization.

Owns: choosing the attention implementation per backend (`enable_flash_attention`: flash-attn 2
when it is importable on CUDA, else torch's `scaled_dot_product_attention`, whose flash and
memory-efficient kernels torch picks itself) and swapping each RMS norm whose numbers a fused kernel
reproduces (`enable_fused_normalization`: torch's `rms_norm` kernel, on CPU and CUDA; apex is not
used yet). A norm carrying a module hook (the sharder's guard against an uncovered per-head norm, a
style's hook) is kept, so no check or gradient rule is lost. Each switch logs one line saying what
it chose. Must not shard: it runs after the sharder,
on the per-rank heads and shards it left, and keeps every weight (same `nn.Parameter`).
"""

from __future__ import annotations

import copy
import importlib.util
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

logger = logging.getLogger("meshboost.shardformer")


def _say(message: str, *args) -> None:
    """The one line a switch prints about its choice: a warning (shown by default), on global rank 0."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning(message, *args)


def attention_implementation(device_type: str) -> str:
    """flash-attn 2 on CUDA when importable, else torch's SDPA."""
    if device_type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def use_fast_attention(model: nn.Module, device_type: str) -> str:
    """Set the model's attention implementation (transformers' `set_attn_implementation`): the
    first of flash-attn 2 / SDPA the model supports, else it keeps its own. Returns the choice."""
    wanted = attention_implementation(device_type)
    chain = [wanted, "sdpa"] if wanted != "sdpa" else ["sdpa"]
    current = getattr(getattr(model, "config", None), "_attn_implementation", None)
    setter = getattr(model, "set_attn_implementation", None)
    for impl in chain:
        if setter is None:
            break
        try:
            setter(impl)
        except (ValueError, ImportError) as e:          # transformers: the model or kernel does not support it
            logger.info("meshboost: attention %s not available for %s (%s)", impl, type(model).__name__, e)
            continue
        why = "" if impl == "flash_attention_2" else \
            " (flash-attn 2 needs CUDA, the flash_attn package and model support)"
        _say("meshboost: enable_flash_attention -> attention %r%s, was %r", impl, why, current)
        return impl
    _say("meshboost: enable_flash_attention -> %s supports neither flash-attn 2 nor SDPA; keeps %r",
         type(model).__name__, current)
    return current


class FusedRMSNorm(nn.Module):
    """An RMS norm computed by torch's fused `rms_norm` kernel in fp32, cast back to the input dtype,
    then scaled by the same weight, in the order transformers' Llama-style norms use."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), eps=self.eps)
        return self.weight * normed.to(dtype)


def _rms_parts(module: nn.Module):
    """(weight, eps) of a module that looks like an RMS norm over the last dim, else None."""
    if not type(module).__name__.endswith("RMSNorm") or type(module) is FusedRMSNorm:
        return None
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 1 or not isinstance(eps, float):
        return None
    return weight, eps


def _same_numbers(module: nn.Module, weight: nn.Parameter, eps: float) -> bool:
    """Probe a weightful copy with a random weight and input (fp32, then bf16): the fused norm must
    give the module's numbers (a norm scaling by 1 + weight, Gemma's, or keeping fp32, does not)."""
    size = weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    probe_weight = nn.Parameter(torch.randn(size, generator=generator))
    original = copy.deepcopy(module)
    original = original.to_empty(device="cpu") if any(t.is_meta for t in original.parameters()) \
        else original.to(device="cpu")
    original.weight = probe_weight
    x = torch.randn(3, size, generator=generator) * 3
    with torch.no_grad():
        for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
            want = original.to(dtype)(x.to(dtype))
            got = FusedRMSNorm(probe_weight.to(dtype), eps)(x.to(dtype))
            if want.dtype != got.dtype or not torch.allclose(want.float(), got.float(), atol=atol, rtol=0):
                return False
    return True


def fuse_norms(model: nn.Module, device_type: str) -> int:
    """Swap every RMS norm whose numbers the fused kernel reproduces (checked once per class by a
    probe) for `FusedRMSNorm` holding the same weight. Returns how many were swapped."""
    verdict: dict[type, bool] = {}
    swaps, hooked = [], 0
    for name, module in model.named_modules():
        parts = _rms_parts(module)
        if parts is None:
            continue
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks:
            hooked += 1                 # a guard or style hook lives on this module: swapping would drop it
            continue
        if type(module) not in verdict:
            verdict[type(module)] = _same_numbers(module, *parts)
        if verdict[type(module)]:
            swaps.append((name, FusedRMSNorm(*parts)))
    for name, fused in swaps:
        parent_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, leaf, fused)
    kept = sorted(t.__name__ for t, ok in verdict.items() if not ok)
    _say("meshboost: enable_fused_normalization -> %d RMS norms on torch's fused rms_norm kernel%s; LayerNorm is "
         "torch's fused kernel already%s", len(swaps), " (apex is not used)" if device_type == "cuda" else "",
         (f"; kept, the fused kernel differs from their numbers: {kept}" if kept else "")
         + (f"; kept {hooked} carrying module hooks" if hooked else ""))
    return len(swaps)
