"""What HybridParallelPlugin will build for one model, decided before anything is changed or any
collective runs: `check_model` reads the model, the plugin's config and its parallel layout (the mesh's
`ParallelDims`) and returns a `ModelPlan`, or raises the same refusal on every rank.

Owns: the model-dependent checks of `configure` (meta and lazily built models against the reducer,
ZeRO-3's model rules, expert parallelism and adapters on experts, the router-bias update, context
parallelism's attention and loss, activation checkpointing's counts against every stage). Pure: reads,
never writes; the plugin builds from the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from meshboost.lazy import lazy_seed
from meshboost.pipeline import get_layout, stage_split
from meshboost.pipeline.checkpointing import checkpoint_plan
from meshboost.plugins.config import DDP, FSDP, HybridParallelConfig
from meshboost.plugins.hybrid_zero3 import check_zero3_model
from meshboost.plugins.router_bias import check_model as check_router_bias
from meshboost.shardformer import pipeline_layout, uses_causal_lm_loss
from meshboost.shardformer.context_checks import check_context
from meshboost.shardformer.layers.expert_parallel import check_expert_parallel
from meshboost.shardformer.lora import lora_dropout, transformers_model
from meshboost.shardformer.lora_experts import check_ep_adapters


@dataclass(frozen=True)
class ModelPlan:
    """What to build for the model, every check passed."""

    hf: nn.Module                   # the transformers model (inside a peft model: its adapters are sharded with it)
    lazy: object | None             # LazyInitContext's seed: materialised after sharding, this rank's part only
    on_meta: bool                   # on meta (not lazy): stays there until booster.load_model materialises it
    checkpointed: Callable | None   # stages -> (layer, checkpointed) plan, with gradient_checkpoint_config
    attention: object | None        # context parallelism's attention kind (cp_size > 1)


def check_model(model: nn.Module, optimizer, config: HybridParallelConfig, dims, reducer: str) -> ModelPlan:
    """The plan for `model` under `config` on a mesh of `dims` with data-parallel `reducer`, or the refusal
    (pure: raises alike on every rank, before anything is changed)."""
    lazy = lazy_seed(model)
    on_meta = lazy is None and any(p.is_meta for p in model.parameters())
    if on_meta and reducer == DDP:
        raise ValueError(f"a meta-device model cannot be boosted with dp_size={dims.dp} and zero_stage=0 (torch DDP "
                         "needs real weights); use zero_stage=1 or 2, or build the model with real weights")
    if reducer == FSDP:
        check_zero3_model(model, optimizer, on_meta)
    hf = transformers_model(model)
    checkpointed = checkpointed_layers(hf, config)
    if dims.ep > 1:
        check_expert_parallel(hf, dims.ep)
        check_ep_adapters(hf, dims.ep)                      # LoRA on experts
    check_router_bias(hf, config.moe_router_bias_update_rate)
    attention = None
    if dims.cp > 1:
        attention = check_context(hf, dims.cp, dims.tp, dims.cp_mode)
        p = lora_dropout(model)
        if p > 0:
            raise NotImplementedError(f"lora_dropout={p} with cp_size={dims.cp}: every context-parallel rank "
                                      "would draw the same mask on its own piece of the sequence, not one mask over "
                                      "the whole; use lora_dropout=0.0 with context parallelism")
        if not uses_causal_lm_loss(hf):
            raise NotImplementedError(f"cp_size={dims.cp}: {type(hf).__name__} does not compute its causal-LM "
                                      "loss through transformers' loss_function; use cp_size=1")
    return ModelPlan(hf, lazy, on_meta, checkpointed, attention)


def checkpointed_layers(model: nn.Module, config: HybridParallelConfig):
    """With gradient_checkpoint_config: check its counts against every stage's layers (all stages, on every
    rank, before any collective) and return what gives (layer, checkpointed) for this rank's stages once
    they are built."""
    checkpointing = config.gradient_checkpoint
    if checkpointing is None:
        return None
    layout = get_layout(model, pipeline_layout(model, config.custom_policy))
    base = model.base_model
    lists = [base.get_submodule(segment.layers) for segment in layout.segments]
    pc = config.pipeline
    num_stages = pc.num_stages(config.dims.pp)
    ranges = stage_split(layout, base, sum(len(layers) for layers in lists), num_stages, pc.num_layers_per_stage)
    for v, r in enumerate(ranges):
        checkpointing.layers_to_checkpoint(v, len(r), num_stages)

    def plan(stages):
        if stages is None:
            return checkpoint_plan([(0, [layer for layers in lists for layer in layers])], 1, checkpointing)
        mine = [stages.virtual(c) for c in range(stages.num_chunks)]
        return checkpoint_plan([(v, [stages.kept[i] for i in stages.layer_ranges[v]]) for v in mine],
                               num_stages, checkpointing)
    return plan
