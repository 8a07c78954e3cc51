"""Per-rank memory accounting of training state, measured and in theory.

Owns: `memory_breakdown` (bytes this rank holds now: working weights, working/reduced gradients,
fp32 master weights, optimizer states, counted once per storage) and `memory_theory` (the ZeRO
paper's figures for K = 12 bytes of Adam state per parameter: weights w*Psi/tp, gradients
w*Psi/tp (ZeRO-2: /dp), masters + moments 12*Psi/(tp*dp)). `benchmarks/memory.py` prints both
for a small GPT-2 and Llama. Must not allocate or communicate.
"""

from __future__ import annotations

import torch
import torch.nn as nn

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _bytes(tensors, seen: set, skip_scalars: bool = False) -> int:
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = getattr(t, "_local_tensor", t)           # a DTensor counts this rank's shard
        if skip_scalars and t.dim() == 0:            # Adam's step counters
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def memory_breakdown(model: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes this rank holds now, by kind: working weights, gradients (ZeRO-2's reduced partitions
    included), fp32 masters (tensors the inner optimizer steps that are not the weights) and
    optimizer states. Call it after backward (before step) to see gradients."""
    seen: set = set()
    params = list(model.parameters())
    working = _bytes(params, seen)
    grads = _bytes([p.grad for p in params], seen)
    if hasattr(optimizer, "grad_bytes"):
        grads += optimizer.grad_bytes()
    inner = optimizer
    while inner is not None and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.unwrap() if hasattr(inner, "unwrap") else getattr(inner, "optim", None)
    masters = _bytes([m for g in inner.param_groups for m in g["params"]], seen) if inner is not None else 0
    states = _bytes([v for s in inner.state.values() for v in s.values()], seen, skip_scalars=True) \
        if inner is not None else 0
    return {"working_weights": working, "gradients": grads, "fp32_masters": masters, "optimizer_states": states,
            "total": working + grads + masters + states}


def memory_theory(num_params: int, tp_size: int = 1, dp_size: int = 1, zero_stage: int = 0,
                  precision: str = "fp16", state_bytes_per_param: int = 8) -> dict[str, float]:
    """Bytes per rank in theory for `num_params` (Psi) parameters; Adam keeps two fp32 moments
    (8 bytes). fp32 training keeps no separate masters."""
    w = _BYTES[precision]
    shard = num_params / tp_size
    partition = dp_size if zero_stage > 0 else 1
    out = {"working_weights": w * shard,
           "gradients": w * shard / (dp_size if zero_stage >= 2 else 1),
           "fp32_masters": 0.0 if precision == "fp32" and zero_stage == 0 else 4 * shard / partition,
           "optimizer_states": state_bytes_per_param * shard / partition}
    out["total"] = sum(out.values())
    return out


def saved_activation_bytes(run) -> tuple[int, dict, object]:
    """(bytes autograd holds for backward after `run()`, {(storage, offset, shape, dtype): bytes} of
    each saved view counted once, run's result): activation memory after a forward."""
    saved = {}

    def pack(t):
        saved[(t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)] = \
            t.numel() * t.element_size()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return sum(saved.values()), saved, result
