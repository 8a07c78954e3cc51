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

from meshboost.optim.precision import PRECISION_DTYPES


def _bytes(tensors, seen: dict, skip_scalars: bool = False) -> int:
    """Bytes of `tensors` not already counted: `seen` maps a storage to the byte ranges counted in
    it, so a view into counted memory (ZeRO's fp32 master that is a slice of the weights' flat
    buffer, a tied weight) adds only what it does not share."""
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = getattr(t, "_local_tensor", t)           # a DTensor counts this rank's shard
        if skip_scalars and t.dim() == 0:            # Adam's step counters
            continue
        size = t.element_size()
        lo = t.storage_offset() * size
        hi = lo + t.numel() * size
        ranges = seen.setdefault((t.device, t.untyped_storage().data_ptr()), [])
        new = hi - lo
        for a, b in _merged(ranges):
            new -= max(0, min(b, hi) - max(a, lo))
        ranges.append((lo, hi))
        total += new
    return total


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[list[int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def memory_breakdown(model: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes this rank holds now, by kind: working weights, gradients (ZeRO-2's reduced partitions
    included), fp32 masters (tensors the inner optimizer steps that are not the weights) and
    optimizer states. Call it after backward (before step) to see gradients."""
    seen: dict = {}
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
                  precision: str = "fp16", state_bytes_per_param: int = 8,
                  overlap_communication: bool = False) -> dict[str, float]:
    """Bytes per rank in theory for `num_params` (Psi) parameters after backward; Adam keeps two fp32
    moments (8 bytes). fp32 training keeps no separate masters (ZeRO included: its master shard is the
    weights' own owned slice; cpu_offload's host masters are not device memory). ZeRO-1 with
    overlap_communication reduce-scatters during backward and frees the full gradients, so after
    backward it holds only its partition, as ZeRO-2 does (it still needs the full ones while backward
    runs, and ZeRO-2 with pipeline parallelism until the schedule is done)."""
    w = PRECISION_DTYPES[precision].itemsize
    shard = num_params / tp_size
    partition = dp_size if zero_stage > 0 else 1
    out = {"working_weights": w * shard,
           "gradients": w * shard / (dp_size if zero_stage >= 2 or (zero_stage == 1 and overlap_communication)
                                     else 1),
           # fp32: the weights are the masters (ZeRO's master shard is a view of the weights' flat buffer)
           "fp32_masters": 0.0 if precision == "fp32" else 4 * shard / partition,
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
