"""A model's pipeline anatomy (which modules each stage runs) and how its layers split over stages.

Owns: `StageLayout`, a sequence of `Segment`s (one for a decoder or encoder model; two for an
encoder-decoder; one per tower for a model chaining several), each naming, relative to
`model.base_model`, the module whose forward runs it (`stack`), the embeddings it starts with, its
`nn.ModuleList` of layers, its tail (final norm, pooler, head) and the extra layer outputs a stage
boundary must carry (T5's position bias); choosing a model's layout (the one its family's policy
declares, passed in by the plugin, else transformers' own `config.base_model_pp_plan`); and
`split_layers` (contiguous over the layers of every segment in order, even, remainder to the
middle stages; stages without layers where `empty_stage_refusal` finds none). Must not touch a
model (cutting one lives in cut.py) nor know a family.

Every module outside the base model (LM head, classifier, ...) belongs to the last stage. The
layout is checked against the model's parameters, so a family whose layout misses a parameter
fails loudly instead of silently dropping it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn as nn

SEGMENT_KEYS = ("stack", "embeddings", "layers", "tail", "carry", "counted_by", "shared_groups", "embedding_inputs",
                "leading_layers")


@dataclass(frozen=True)
class Carry:
    """A layer output that the next layer of the same segment receives as an argument (T5 layers
    return the position bias the first layer computed, and the stack passes it to the next one):
    output[`output`] -> positional argument `position`, or keyword `name` when called with fewer."""

    output: int
    position: int
    name: str


@dataclass(frozen=True)
class Segment:
    """One layer stack of a model.

    stack: path of the module whose forward runs embeddings -> layers -> tail and returns the
        segment's output first (`output[0]`, e.g. `last_hidden_state`); "" for the base model itself
        (a one-segment layout). A later segment reads it: T5's decoder, the encoder's output.
    embeddings: modules that turn the inputs into the first hidden states (run by the stage holding
        the segment's first layer).
    layers: path of the `nn.ModuleList` of layers. Each layer takes the hidden states as its first
        argument and returns them (or a tuple starting with them).
    tail: modules after the layers, run by the stage holding the segment's last layer.
    carry: extra layer outputs a boundary inside the segment carries (see `Carry`).
    counted_by: path of the module whose `config.num_hidden_layers` the stack loops over
        (`for i in range(self.config.num_hidden_layers): self.layer[i]`, BLIP-2's Q-Former) instead of
        iterating the list; while a chunk runs it reads the chunk's count. "" for stacks that iterate.
    shared_groups: the config attribute (of `counted_by`'s config) counting the groups in `layers`
        when the stack runs `num_hidden_layers` iterations over fewer shared groups, iteration i using
        group int(i / (num_hidden_layers / groups)) (ALBERT). The stages then split the iterations;
        a group's weights are held by every stage running one of its iterations (tied over them).
    embedding_inputs: model inputs only the segment's embeddings read (a vision tower's pixel values),
        withheld from a chunk that starts inside the segment, whose embeddings are stand-ins: the model
        then skips the tower, whose output the received hidden states already hold.
    leading_layers: the first this many layers are each followed, inside the stack's loop, by a step
        reading the embeddings' outputs (Qwen3-VL adds its deepstack visual features after them): they
        must run on the chunk holding the embeddings, none of them as its last layer (a chunk hands on
        its last layer's output, before that step).
    """

    embeddings: tuple[str, ...]
    layers: str
    tail: tuple[str, ...] = ()
    stack: str = ""
    carry: tuple[Carry, ...] = ()
    counted_by: str = ""
    shared_groups: str = ""
    embedding_inputs: tuple[str, ...] = ()
    leading_layers: int = 0


@dataclass(frozen=True)
class StageLayout:
    """The pipeline anatomy of one model family: its segments, run in order."""

    name: str
    segments: tuple[Segment, ...]
    missing: tuple[str, ...] = ()        # layer lists of declared segments this model lacks


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
    return StageLayout(f"pp_plan:{config.model_type}", (Segment(tuple(names[:i]), lists[0], tuple(names[i + 1:])),))


# inputs a vision-language model's forward reads only to run its vision tower
PIXEL_INPUTS = ("pixel_values", "pixel_values_videos", "pixel_attention_mask")


def layout_from_sub_model(base: nn.Module) -> StageLayout | None:
    """A composite model (vision-language) whose top-level config has no `base_model_pp_plan`: one
    segment through its language model, the module built from a sub-config (`text_config`) holding
    the token embedding. Its layer list and the modules around it come from that sub-config's
    `base_model_pp_plan`, else from the language model's children in order (those with parameters
    before the layer list are embeddings, after it the tail); every other child of the base model
    with parameters (the vision tower, the projector) is an embedding, run by the first stage, and
    the pixel inputs are withheld from the other stages."""
    config = getattr(base, "config", None)
    subs = [getattr(config, n) for n in getattr(config, "sub_configs", {}) if getattr(config, n, None) is not None]
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    found = [(name, module) for name, module in base.named_children()
             if any(getattr(module, "config", None) is sub for sub in subs)
             and any(m is embedding for m in module.modules())]       # the language model holds the token embedding
    if len(found) != 1 or embedding is None:
        return None
    path, language = found[0]
    plan = getattr(language.config, "base_model_pp_plan", None)
    if plan:
        names = list(plan)
    else:
        names = [n for n, c in language.named_children() if isinstance(c, nn.ModuleList)
                 or any(True for _ in c.parameters())]
    lists = [n for n in names if isinstance(_get(language, n), nn.ModuleList)]
    if len(lists) != 1:
        return None
    i = names.index(lists[0])
    towers = tuple(name for name, module in base.named_children()
                   if name != path and any(True for _ in module.parameters()))
    embeddings = towers + tuple(f"{path}.{n}" for n in names[:i])
    # visual features a sub-config says are added after the first text layers (Qwen3-VL's deepstack)
    leading = max((len(getattr(sub, "deepstack_visual_indexes", None) or ()) for sub in subs), default=0)
    return StageLayout(f"sub_model:{config.model_type}", (Segment(
        embeddings, f"{path}.{lists[0]}", tuple(f"{path}.{n}" for n in names[i + 1:]),
        embedding_inputs=PIXEL_INPUTS, leading_layers=leading),))


def segment_from_dict(entry: dict, where: str) -> Segment:
    unknown = set(entry) - set(SEGMENT_KEYS)
    if unknown or "layers" not in entry:
        raise ValueError(f"{where}: a pipeline segment needs 'layers' and may have {SEGMENT_KEYS}; "
                         f"got {sorted(entry)}")
    carry = tuple(c if isinstance(c, Carry) else Carry(*c) for c in entry.get("carry", ()))
    return Segment(tuple(entry.get("embeddings", ())), entry["layers"], tuple(entry.get("tail", ())),
                   entry.get("stack", ""), carry, entry.get("counted_by", ""), entry.get("shared_groups", ""),
                   tuple(entry.get("embedding_inputs", ())), int(entry.get("leading_layers", 0)))


def get_layout(model: nn.Module, declared: dict | None = None) -> StageLayout:
    """The layout of `model`: `declared` (from the family's policy: {"embeddings", "layers", "tail"}
    for one segment, {"segments": [...]} for several) or transformers' `base_model_pp_plan`; a
    ValueError naming both ways out otherwise. Segments whose layer list the model lacks
    (`T5EncoderModel` has no decoder) are dropped."""
    base = getattr(model, "base_model", model)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    where = f"pipeline layout of {model_type!r}"
    if declared is not None:
        entries = declared["segments"] if "segments" in declared else [declared]
        declared_segments = tuple(segment_from_dict(e, where) for e in entries)
        segments = tuple(s for s in declared_segments if _get(base, s.layers) is not None)
        missing = tuple(s.layers for s in declared_segments if _get(base, s.layers) is None)
        layout = StageLayout(f"policy:{model_type}", segments, missing) if segments else None
    else:
        layout = layout_from_pp_plan(base) or layout_from_sub_model(base)
    if layout is None:
        raise ValueError(
            f"no pipeline stage layout for {type(model).__name__} (model_type={model_type!r}). Supported: families "
            "whose policy declares one (bert, gpt2, opt, bloom, falcon, vit, t5, whisper) and any model whose config "
            "ships `base_model_pp_plan` (Llama, Qwen2, Mistral, ...). Pass custom_policy=Policy(..., pipeline_layout="
            "{'embeddings': (...), 'layers': ..., 'tail': (...)}) or use pp_size=1.")
    if len(layout.segments) > 1 and any(not s.stack for s in layout.segments):
        raise ValueError(f"layout {layout.name!r}: with several segments each needs its 'stack' module path")
    for segment in layout.segments:
        if segment.shared_groups and not segment.counted_by:
            raise ValueError(f"layout {layout.name!r}: shared_groups needs counted_by (the module whose config "
                             "counts the iterations)")
        layers = _get(base, segment.layers)
        if not isinstance(layers, nn.ModuleList):
            raise ValueError(f"layout {layout.name!r}: {type(base).__name__}.{segment.layers} is not an nn.ModuleList")
        if segment.stack and not isinstance(_get(base, segment.stack), nn.Module):
            raise ValueError(f"layout {layout.name!r}: {type(base).__name__} has no module {segment.stack!r}")
        if len(layers) == 0:
            raise ValueError(f"layout {layout.name!r}: {segment.layers} holds no layer")
    return layout


def empty_stage_refusal(layout: StageLayout, base: nn.Module) -> str | None:
    """Why a (virtual) stage of `layout` cannot hold zero layers, or None when it can: one segment whose stack
    iterates its layer list and whose layers return the hidden states alone. A stage without layers then runs a
    pass-through in their place (run.py): the first stage its embeddings, the last its tail and heads, one in
    between nothing, each handing on exactly the hidden states it got, so the numbers are the model's."""
    if len(layout.segments) != 1:
        return "its layers sit in several stacks, and an empty stage between them has no stack to pass through"
    segment = layout.segments[0]
    if segment.carry or segment.counted_by or segment.shared_groups or segment.leading_layers:
        return (f"its layers in {segment.layers} hand on more than the hidden states (carried outputs, counted or "
                "shared iterations, steps after the first layers)")
    layers = _get(base, segment.layers)
    returns = inspect.signature(type(layers[0]).forward).return_annotation
    if returns is not torch.Tensor and returns not in ("torch.Tensor", "Tensor"):
        return (f"its layers ({type(layers[0]).__name__}) do not declare that they return the hidden states alone, "
                "which a last stage without layers must hand back to the model's loop")
    return None


def split_layers(num_layers: int, num_stages: int, num_layers_per_stage: list[int] | None = None, *,
                 allow_empty: bool = False, why_not_empty: str | None = None) -> list[range]:
    """Contiguous layer ranges, one per (virtual) stage. Even by default, with the remainder given to
    the middle stages (the first holds the embeddings, the last the head); with more stages than layers
    the stages at both ends hold none (ColossalAI's split) when `allow_empty`, else a refusal giving
    `why_not_empty`. Pure: same error on every rank."""
    if num_stages > num_layers and not allow_empty:
        why = f"; a stage would hold no layer, which this model cannot run: {why_not_empty}" if why_not_empty else ""
        raise ValueError(
            f"{num_stages} pipeline stages (pp_size x num_model_chunks) but the model has only {num_layers} "
            f"layers{why}; use at most {num_layers} stages")
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


def stage_split(layout: StageLayout, base: nn.Module, num_layers: int, num_stages: int,
                num_layers_per_stage: list[int] | None = None) -> list[range]:
    """`split_layers` for `layout`'s model (`base`, its base model): stages without layers where it can run them."""
    refusal = empty_stage_refusal(layout, base) if num_stages > num_layers else None
    return split_layers(num_layers, num_stages, num_layers_per_stage, allow_empty=num_stages > num_layers
                        and refusal is None, why_not_empty=refusal)


def _get(root: nn.Module, path: str):
    """The submodule at dotted `path`, or None when any part is missing (e.g. no pooler)."""
    module = root
    for part in path.split(".") if path else ():
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
