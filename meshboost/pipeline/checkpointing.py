"""Per-stage activation checkpointing (ColossalAI's `PipelineGradientCheckpointConfig`).

Owns: choosing which layers of this rank's stages run under HF activation checkpointing: the first
`config.layers_to_checkpoint(...)` layers of each stage, checkpointed only while the user has HF
checkpointing on (`model.gradient_checkpointing_enable()`, whose flag on the base model is read at
every forward, so enabling or disabling it before or after boost keeps working). Must not copy a
forward: transformers 5 layers (`GradientCheckpointingLayer`) read their own `gradient_checkpointing`
flag, which is all this sets.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn


def checkpoint_plan(stages: list[tuple[int, list[nn.Module]]], num_stages: int, config) -> list[tuple[nn.Module, bool]]:
    """(layer, checkpointed) for every layer of this rank's stages, given as (virtual stage, its layers);
    raises (pure, on every rank) for counts that do not fit the stages."""
    plan = []
    for stage, layers in stages:
        count = config.layers_to_checkpoint(stage, len(layers), num_stages)
        plan += [(layer, i < count) for i, layer in enumerate(layers)]
    return plan


def _apply(plan: list[tuple[nn.Module, bool]], model: nn.Module, args, kwargs):
    # the hook's own module is the model: holding it too would make a cycle that outlives a dropped model
    on = bool(getattr(getattr(model, "base_model", model), "gradient_checkpointing", False))
    for layer, wanted in plan:
        if hasattr(layer, "gradient_checkpointing"):
            layer.gradient_checkpointing = on and wanted


def install_checkpoint_plan(model: nn.Module, plan: list[tuple[nn.Module, bool]]) -> None:
    """Set the layers' checkpointing flags from `plan` before every forward of `model`."""
    model.register_forward_pre_hook(partial(_apply, plan), with_kwargs=True, prepend=True)
