"""A model's pipeline anatomy (which modules the first, middle and last stages run) and how its
layers split over stages.

Owns: `StageLayout` (module paths relative to `model.base_model`: the embeddings the first stage
runs, the `nn.ModuleList` of layers the stages share, the tail the last stage runs), choosing a
model's layout (the one its family's policy declares, passed in by the plugin, else transformers'
own `config.base_model_pp_plan`), and `split_layers` (contiguous, even, remainder to the middle
stages). Must not touch a model (stage construction lives in stage.py) nor know a family.

Every module outside the base model (LM head, classifier, ...) belongs to the tail. The layout is
checked against the model's parameters, so a family whose layout misses a parameter fails loudly
instead of silently dropping it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn


@dataclass(frozen=True)
class StageLayout:
    """The pipeline anatomy of one model family (paths relative to the base model).

    embeddings: modules that turn the inputs into the first hidden states (first stage only).
    layers: path of the `nn.ModuleList` of transformer layers, split contiguously over stages.
        Each layer takes the hidden states as its first argument and returns them (or a tuple
        starting with them).
    tail: modules after the layers (final norm, pooler); run by the last stage, which also owns
        every module outside the base model (the heads).
    """

    name: str
    embeddings: tuple[str, ...]
    layers: str
    tail: tuple[str, ...] = ()


def layout_from_pp_plan(base: nn.Module) -> StageLayout | None:
    """Read transformers' `config.base_model_pp_plan` (ordered: embeddings -> layers -> norm):
    the entry that is an `nn.ModuleList` is the layer list, entries before it are embeddings,
    entries after it the tail."""
    config = getattr(base, "config", None)
    plan = getattr(config, "base_model_pp_plan", None)
    if not plan:
        return None
    names = list(plan)
    lists = [n for n in names if isinstance(_get(base, n), nn.ModuleList)]
    if len(lists) != 1:
        return None
    i = names.index(lists[0])
    return StageLayout(f"pp_plan:{config.model_type}", tuple(names[:i]), lists[0], tuple(names[i + 1:]))


def get_layout(model: nn.Module, declared: dict | None = None) -> StageLayout:
    """The layout of `model`: `declared` ({"embeddings", "layers", "tail"}, from the family's policy)
    or transformers' `base_model_pp_plan`; a ValueError naming both ways out otherwise."""
    base = getattr(model, "base_model", model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if declared is not None:
        layout = StageLayout(f"policy:{model_type}", tuple(declared.get("embeddings", ())), declared["layers"],
                             tuple(declared.get("tail", ())))
    else:
        layout = layout_from_pp_plan(base)
    if layout is None and getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        raise ValueError(
            f"{type(model).__name__} (model_type={model_type!r}) is an encoder-decoder model: pipeline stages over "
            "two layer stacks (encoder outputs carried to the decoder stages) are not supported yet; use pp_size=1 "
            "(tensor and data parallelism and ZeRO work for it)")
    if layout is None:
        raise ValueError(
            f"no pipeline stage layout for {type(model).__name__} (model_type={model_type!r}). Supported: families "
            "whose policy declares one (bert, gpt2, opt, bloom, falcon, vit) and any model whose config ships "
            "`base_model_pp_plan` (Llama, Qwen2, Mistral, ...). Pass custom_policy=Policy(..., pipeline_layout="
            "{'embeddings': (...), 'layers': ..., 'tail': (...)}) or use pp_size=1.")
    if not isinstance(_get(base, layout.layers), nn.ModuleList):
        raise ValueError(f"layout {layout.name!r}: {type(base).__name__}.{layout.layers} is not an nn.ModuleList")
    return layout


def split_layers(num_layers: int, num_stages: int, num_layers_per_stage: list[int] | None = None) -> list[range]:
    """Contiguous layer ranges, one per (virtual) stage. Even by default, with the remainder given to
    the middle stages (the first holds the embeddings, the last the head). Pure: same error on every rank."""
    if num_stages > num_layers:
        raise ValueError(
            f"{num_stages} pipeline stages (pp_size x num_model_chunks) but the model has only {num_layers} "
            f"layers; use at most {num_layers} stages")
    if num_layers_per_stage is None:
        counts = [num_layers // num_stages] * num_stages
        extra = num_layers % num_stages
        start = num_stages // 2 - extra // 2
        for i in range(start, start + extra):
            counts[i] += 1
    else:
        counts = list(num_layers_per_stage)
        if len(counts) != num_stages or any(not isinstance(c, int) or c < 1 for c in counts) \
                or sum(counts) != num_layers:
            raise ValueError(
                f"num_layers_per_stage={num_layers_per_stage} must list {num_stages} positive integers "
                f"(one per stage, pp_size x num_model_chunks) summing to the model's {num_layers} layers")
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges


def _get(root: nn.Module, path: str):
    """The submodule at dotted `path`, or None when any part is missing (e.g. no pooler)."""
    module = root
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
