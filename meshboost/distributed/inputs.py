"""What a boosted model does to its inputs before running: floating-point tensors (pixel values,
audio features, `inputs_embeds`, float masks) take the working precision of the weights, so a
script feeding fp32 features to an fp16/bf16 model runs as it does in ColossalAI (whose
HybridParallelModule casts them too). Integer tensors (token ids, labels) are untouched.
Must not know plugins or models.
"""

from __future__ import annotations

import torch


def cast_floating(value, dtype: torch.dtype | None):
    """`value` with every floating-point tensor (nested in dicts, lists and tuples) cast to `dtype`;
    unchanged when `dtype` is None or fp32 (no copy)."""
    if dtype is None or dtype == torch.float32:
        return value
    if torch.is_tensor(value):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if type(value) is dict:
        return {k: cast_floating(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(cast_floating(v, dtype) for v in value)
    return value
