"""Activation checkpointing's two modes: whole blocks recomputed ("full") or only their cheap ops ("selective").

Owns: `CHECKPOINTING` (the accepted modes), `check_checkpointing`, `selective_policy` (the op-level rule:
keep the outputs of matmuls and attention kernels, recompute norms, activations, softmax and dropouts),
`checkpointing_kwargs` (what transformers passes to `torch.utils.checkpoint.checkpoint`) and
`enable_checkpointing(model, mode)`. Must not fork a forward or pick the layers: transformers'
`GradientCheckpointingLayer` checkpoints each block with the kwargs given to
`gradient_checkpointing_enable`, and this only adds torch's `create_selective_checkpoint_contexts` as the
non-reentrant checkpoint's `context_fn`. The per-stage counts (`PipelineGradientCheckpointConfig`) keep
choosing which blocks are checkpointed; this decides what a checkpointed block keeps.

Why the dropouts replay. Recomputed ops run again in the forward's order from the random generator
states `checkpoint` restored, and a kept op is not run again, so a kept op must draw nothing: matmuls never
do, and an attention kernel is kept only when its `dropout_p` is 0. A fused kernel with dropout (CUDA's
flash / efficient SDPA) advances the generator's philox offset; kept, it would leave every later random op
of the recompute (a residual dropout) on a shifted offset, a different mask: a silent wrong gradient. It is
recomputed instead. So every mask, and the per-tp-rank stream switches of `rng.py` (a `randint` draw,
recomputed), come out the same.

Why the collectives are recomputed, never kept. meshboost's collectives (`distributed/comm.py`) are the
in-place c10d ops writing into a buffer the caller then reads; a kept (cached) in-place op would hand back
its old result without writing the new buffer: a silent wrong number. Recomputing one is costly, not
wrong: every rank of a tp group recomputes the same block at the same point of its backward (the same
graph, the same early stop), so each re-issued collective is matched on all of them, as under "full".
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

FULL, SELECTIVE = "full", "selective"
CHECKPOINTING = (FULL, SELECTIVE)

_aten = torch.ops.aten
_KEPT_NAMES = (  # matmuls and attention kernels (overloads resolved below; absent ones skipped)
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_int_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward",
)
KEPT_OPS = frozenset(op for name in _KEPT_NAMES if hasattr(_aten, name) for op in
                     (getattr(getattr(_aten, name), o) for o in getattr(_aten, name).overloads()))


def _in_place_collective(func) -> bool:
    return func.namespace == "c10d"


def _draws_dropout(func, args, kwargs) -> bool:
    """Whether the op has a nonzero `dropout_p` argument (by its schema, positional or keyword)."""
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "dropout_p":
            p = kwargs.get("dropout_p", args[i] if i < len(args) else argument.default_value)
            return bool(p)
    return False


def selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul outputs and those of attention kernels without dropout; recompute everything else,
    collectives always."""
    if func in KEPT_OPS and not _draws_dropout(func, args, kwargs):
        return CheckpointPolicy.MUST_SAVE
    if _in_place_collective(func):
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_RECOMPUTE


def check_checkpointing(mode: str | None) -> str | None:
    if mode is not None and mode not in CHECKPOINTING:
        raise ValueError(f"checkpointing={mode!r}; expected one of {CHECKPOINTING} or None (no recomputation)")
    return mode


def checkpointing_kwargs(mode: str, policy=selective_policy) -> dict:
    """The kwargs transformers hands to `torch.utils.checkpoint.checkpoint` for `mode` (non-reentrant:
    the only form that takes a `context_fn`)."""
    check_checkpointing(mode)
    kwargs = {"use_reentrant": False}
    if mode == SELECTIVE:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, policy)
    return kwargs


def enable_checkpointing(model: nn.Module, mode: str | None = SELECTIVE, policy=selective_policy) -> None:
    """Turn transformers' activation checkpointing on for `model` in `mode` (None: leave it as it is).
    Same as `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(mode))`."""
    if check_checkpointing(mode) is None:
        return
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=checkpointing_kwargs(mode, policy))
    else:       # transformers before 5.x's rename
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs(mode, policy))
