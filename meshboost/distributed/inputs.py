"""What a boosted model does to its inputs before running: floating-point tensors (pixel values,
audio features, `inputs_embeds`, float masks) take the working precision of the weights, so a
script feeding fp32 features to an fp16/bf16 model runs as it does in ColossalAI (whose
HybridParallelModule casts them too). Integer tensors (token ids, labels) are untouched. And how
many labelled items a batch's loss averages over (`count_items`, which pipeline normalisation and
context parallelism both read). Must not know plugins or models.
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


def count_items(labels: torch.Tensor, shifted: bool, ignore_index: int = -100) -> torch.Tensor:
    """Labelled items the loss averages over: labels other than `ignore_index`, from position 1
    on when the model shifts them (a causal LM predicts token t + 1 from tokens <= t)."""
    if shifted and labels.dim() > 1:
        labels = labels[..., 1:]
    return (labels != ignore_index).sum()
