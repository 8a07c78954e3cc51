"""Cutting an unmodified HuggingFace model into one pipeline rank's stages.

Owns: `build_stages`: placing the layout's segments on the model's global layer numbering and the
layers on virtual stages, checking that the layout places every parameter, finding the weights
that several pipeline ranks hold (an embedding tied to the LM head), and removing from the model,
in place, every module this rank's stages do not hold (so the model keeps its class, its parameter
names and its own forward); `prune_optimizer`. Every check runs before the model is touched, and
none communicates, so every rank raises the same error. What a cut leaves is a `PipelineStages`
(stage.py); running a chunk of it lives in run.py. Nothing here writes to the model's config.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.distributed.param_info import PipelineTie, set_pipeline_tie
from meshboost.pipeline.layout import Segment, StageLayout, get_layout, stage_split
from meshboost.pipeline.stage import PipelineStages, SegmentSpan, StageLayerList
from meshboost.pipeline.stand_ins import AbsentLayer, AbsentModule, put_at, stand_in_for


def build_stages(model: nn.Module, pp_rank: int, pp_size: int, num_chunks: int = 1,
                 num_layers_per_stage: list[int] | None = None, layout: dict | None = None) -> PipelineStages:
    """Cut `model` in place down to the chunks of pipeline rank `pp_rank`. `layout`: the family's
    declared pipeline layout (see `get_layout`). Every check runs before the model is touched, and
    none communicates, so every rank raises the same error."""
    layout = get_layout(model, layout)
    base = getattr(model, "base_model", model)
    originals = [base.get_submodule(s.layers) for s in layout.segments]     # the model's own layer lists
    _check_can_cut(model, originals)
    num_virtual = pp_size * num_chunks
    spans, layer_ranges = _place_segments(model, base, layout, originals, num_virtual, num_layers_per_stage)
    stage_of = {i: v for v, r in enumerate(layer_ranges) for i in r}
    tie_sets = _tie_sets(_parameter_owners(model, base, layout, spans, stage_of, num_virtual), pp_size)

    held = {i for v in range(pp_rank, num_virtual, pp_size) for i in layer_ranges[v]}
    kept = {i: _layer_at(span, originals[j], i - span.offset)
            for j, span in enumerate(spans) for i in range(span.offset, span.stop) if i in held}
    stand_ins = {p: stand_in_for(_resolve(base, p)) for s in layout.segments for p in s.embeddings
                 if _resolve(base, p) is not None}
    _cut(model, base, spans, originals, kept, stand_ins, stage_of, pp_rank, pp_size)
    ties = _mark_ties(tie_sets, pp_rank)
    first_list = next(span.layer_list for span in spans if span.layer_list is not None)
    model.register_forward_pre_hook(_only_through_schedule(first_list))
    return PipelineStages(model, layout, pp_rank, pp_size, num_chunks, layer_ranges, spans, kept, stand_ins,
                          config_holders=_config_holders(model, spans), ties=ties)


def _check_can_cut(model: nn.Module, originals: list[nn.ModuleList]) -> None:
    if getattr(getattr(model, "config", None), "use_weighted_layer_sum", False):
        raise ValueError(f"{type(model).__name__} has config.use_weighted_layer_sum=True: its head mixes the hidden "
                         "states of every layer, which no pipeline stage holds; use pp_size=1, or "
                         "use_weighted_layer_sum=False")
    if any(isinstance(layer_list, StageLayerList) for layer_list in originals):
        raise ValueError(f"{type(model).__name__} was already cut into pipeline stages by an earlier boost: boost the "
                         "original model once; to start over, build a fresh model (or load its checkpoint into one)")


def _place_segments(model: nn.Module, base: nn.Module, layout: StageLayout, originals: list[nn.ModuleList],
                    num_virtual: int, num_layers_per_stage: list[int] | None) -> tuple[list[SegmentSpan], list[range]]:
    """Each segment's span of the global layer numbering, and each virtual stage's layers."""
    # group of each iteration, for a segment whose stack loops over shared layer groups (ALBERT)
    groups = [_iteration_groups(base, s, layers) for s, layers in zip(layout.segments, originals)]
    sizes = [len(g) if g is not None else len(layers) for g, layers in zip(groups, originals)]
    layer_ranges = stage_split(layout, base, sum(sizes), num_virtual, num_layers_per_stage)
    stage_of = {i: v for v, r in enumerate(layer_ranges) for i in r}
    # the stages running a segment's ends: those of its first and last layers, or with stages holding no layer
    # (one segment only, layout.empty_stage_refusal) the first and the last stage, as ColossalAI places them
    empty = any(len(r) == 0 for r in layer_ranges)
    spans, offset = [], 0
    for segment, group, size in zip(layout.segments, groups, sizes):
        stack = base.get_submodule(segment.stack)
        counted = base.get_submodule(segment.counted_by).config if segment.counted_by else None
        # the per-layer lists a chunk reads live in the config of the module iterating the layers (a
        # vision-language model's text_config, not the top-level config its stack holds)
        owner = base.get_submodule(segment.layers.rpartition(".")[0])
        config = getattr(owner, "config", None) or getattr(stack, "config", getattr(model, "config", None))
        spans.append(SegmentSpan(segment, offset, size, group, first_stage=0 if empty else stage_of[offset],
                                 last_stage=num_virtual - 1 if empty else stage_of[offset + size - 1], config=config,
                                 counted_config=counted))
        first = layer_ranges[stage_of[offset]]
        if segment.leading_layers and offset + segment.leading_layers not in first:
            raise ValueError(
                f"{type(model).__name__}: layers {offset}..{offset + segment.leading_layers - 1} of {segment.layers} are "
                "each followed by a step reading the first stage's embeddings (deepstack visual features), so the "
                f"first pipeline stage must hold at least {segment.leading_layers + 1} of its layers; it holds "
                f"{len(first)}: pass num_layers_per_stage (e.g. [{segment.leading_layers + 1}, ...]) or use fewer stages")
        offset += size
    return spans, layer_ranges


def _iteration_groups(base: nn.Module, segment: Segment, layer_list: nn.ModuleList) -> list[int] | None:
    """The group each iteration uses (HF's own formula), for a segment with shared groups."""
    if not segment.shared_groups:
        return None
    config = base.get_submodule(segment.counted_by).config
    iterations, count = config.num_hidden_layers, getattr(config, segment.shared_groups)
    if count != len(layer_list):
        raise ValueError(f"{segment.layers} holds {len(layer_list)} groups but config.{segment.shared_groups}="
                         f"{count}; the layout's shared_groups must name the attribute counting them")
    return [int(i / (iterations / count)) for i in range(iterations)]


def _parameter_owners(model: nn.Module, base: nn.Module, layout: StageLayout, spans: list[SegmentSpan],
                      stage_of: dict[int, int], num_virtual: int) -> list[tuple[nn.Parameter, set[int]]]:
    """Each parameter of `model` (once) with the virtual stages holding it; raises for one the layout
    does not place."""
    base_prefix = next((n for n, m in model.named_modules() if m is base), "")
    owners: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        stages = _owning_stages(name, base_prefix, spans, stage_of, num_virtual)
        if not stages:
            why = (f" (this {type(model).__name__} lacks the layout's {list(layout.missing)}: a variant the layout "
                   "does not describe)" if layout.missing else "")
            raise ValueError(f"pipeline layout {layout.name!r} does not place parameter {name!r}{why}; add its module "
                             "to the layout's embeddings or tail (the family's Policy(pipeline_layout=...)) or use "
                             "pp_size=1")
        owners.setdefault(id(p), (p, set()))[1].update(stages)
    return list(owners.values())


def _owning_stages(name: str, base_prefix: str, spans: list[SegmentSpan], stage_of: dict[int, int],
                   num_virtual: int) -> set[int] | None:
    """Virtual stages holding the parameter `name` (a full model name), or None if the layout misses it."""
    if base_prefix and not name.startswith(base_prefix + "."):
        return {num_virtual - 1}                                      # a head: outside the base model
    rel = name[len(base_prefix) + 1:] if base_prefix else name
    for span in spans:
        segment = span.segment
        if any(_under(rel, p) for p in segment.embeddings):
            return {span.first_stage}
        if rel.startswith(segment.layers + "."):
            entry = int(rel[len(segment.layers) + 1:].split(".", 1)[0])
            return {stage_of[span.offset + it] for it in span.iterations_of(entry)}
        if any(_under(rel, p) for p in segment.tail):
            return {span.last_stage}
    return None


def _tie_sets(owners: list[tuple[nn.Parameter, set[int]]], pp_size: int) -> dict[tuple[int, ...], list[nn.Parameter]]:
    """Weights held by more than one pipeline rank, by the set of those ranks."""
    tie_sets: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for p, stages in owners:
        ranks = tuple(sorted({v % pp_size for v in stages}))
        if len(ranks) > 1:
            tie_sets.setdefault(ranks, []).append(p)
    return tie_sets


def _layer_at(span: SegmentSpan, original: nn.ModuleList, iteration: int) -> nn.Module:
    """The module running the segment's `iteration`-th layer: the layer, or a shared group's wrapper."""
    if span.groups is None:
        return original[iteration]
    return _Iteration(original[span.entry(iteration)])


def _cut(model: nn.Module, base: nn.Module, spans: list[SegmentSpan], originals: list[nn.ModuleList],
         kept: dict[int, nn.Module], stand_ins: dict, stage_of: dict[int, int], pp_rank: int, pp_size: int) -> None:
    """Replace in place what this rank does not hold: embeddings by stand-ins, tails and heads by
    `AbsentModule`, layer lists by `StageLayerList`s (a stack with no layer here by `AbsentModule`)."""
    absent_stacks = []
    for j, span in enumerate(spans):
        _replace_ends(base, span, stand_ins, "last" if j == len(spans) - 1 else "other", pp_rank, pp_size)
        mine, original = _held_entries(span, originals[j], kept), originals[j]
        if mine or not span.segment.stack:
            absent = {i: AbsentLayer(original[i], f"{span.segment.layers}.{i}", _holders(span, i, stage_of, pp_size))
                      for i in range(len(original)) if i not in mine}
            span.layer_list = StageLayerList(mine, absent)
            put_at(base, span.segment.layers, span.layer_list)
        else:
            absent_stacks.append(span.segment.stack)
    for path in absent_stacks:                 # a segment with no layer here: nothing in its stack is held
        put_at(base, path, AbsentModule(path, "other"))
    if pp_rank != pp_size - 1:
        _drop_heads(model, base)


def _replace_ends(base: nn.Module, span: SegmentSpan, stand_ins: dict, tail_owner: str, pp_rank: int,
                  pp_size: int) -> None:
    """A segment's embeddings become stand-ins off the stage holding its first layer; its tail
    becomes `AbsentModule` off the stage holding its last."""
    if span.first_stage % pp_size != pp_rank:
        for path in (p for p in span.segment.embeddings if p in stand_ins):
            put_at(base, path, stand_ins[path])
    if span.last_stage % pp_size != pp_rank:
        for path in (p for p in span.segment.tail if _resolve(base, p) is not None):
            put_at(base, path, AbsentModule(path, tail_owner))


def _drop_heads(model: nn.Module, base: nn.Module) -> None:
    """Every module with weights outside the base model (LM head, classifier) lives on the last stage."""
    heads = [] if model is base else list(model.named_children())
    for name, child in heads:
        if child is not base and any(True for _ in child.parameters()):
            setattr(model, name, AbsentModule(name, "last"))


def _held_entries(span: SegmentSpan, original: nn.ModuleList, kept: dict[int, nn.Module]) -> dict[int, nn.Module]:
    """The entries of the segment's layer list this rank holds, by their index in it (for shared
    groups: the groups themselves, under their own indices)."""
    mine = {i - span.offset: kept[i] for i in range(span.offset, span.stop) if i in kept}
    if span.groups is not None:
        mine = {g: original[g] for g in sorted({span.entry(i) for i in mine})}
    return mine


def _holders(span: SegmentSpan, entry: int, stage_of: dict[int, int], pp_size: int) -> list[int]:
    """The pipeline ranks holding entry `entry` of the segment's layer list (a layer, or a shared group)."""
    return sorted({stage_of[span.offset + it] % pp_size for it in span.iterations_of(entry)})


def _mark_ties(tie_sets: dict[tuple[int, ...], list[nn.Parameter]], pp_rank: int) -> list:
    """(pp ranks, the tied weights held here) for every tie set, the same sets on every rank."""
    ties = []
    for ranks, tied in sorted(tie_sets.items()):
        here = pp_rank in ranks
        if here:
            for p in tied:
                # The lowest holder's copy is the weight; the others are replicas (not counted twice in norms).
                set_pipeline_tie(p, PipelineTie(replica=pp_rank != ranks[0]))
        ties.append((ranks, tied if here else []))
    return ties


def _config_holders(model: nn.Module, spans: list[SegmentSpan]) -> dict[int, list[nn.Module]]:
    """id(config) -> the modules of the cut model holding it as `self.config`, for the configs a
    chunk may show a view of (run.py)."""
    wanted = {id(c) for span in spans for c in (span.config, span.counted_config) if c is not None}
    holders: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        config = vars(module).get("config")
        if config is not None and id(config) in wanted:
            holders.setdefault(id(config), []).append(module)
    return holders


def _only_through_schedule(layer_list: StageLayerList):
    def hook(module, args):
        if layer_list.running is None:
            raise RuntimeError("this model is one pipeline stage; with pp_size > 1 run it through "
                               "booster.execute_pipeline(data_iter, model, criterion, optimizer)")
    return hook


class _Iteration(nn.Module):
    """One iteration of a shared layer group (ALBERT runs its group num_hidden_layers times): a
    distinct object per iteration, so a stage's hooks fire at its own first and last iteration."""

    def __init__(self, group: nn.Module):
        super().__init__()
        self.__dict__["group"] = group                 # not a submodule: the model tree holds the group

    def forward(self, *args, **kwargs):
        return self.group(*args, **kwargs)


def _under(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".")


def _resolve(root: nn.Module, path: str) -> nn.Module | nn.Parameter | None:
    """The module or parameter at `path`, or None when the model has none there."""
    parent_path, _, leaf = path.rpartition(".")
    try:
        parent = root.get_submodule(parent_path) if parent_path else root
    except AttributeError:
        return None
    value = getattr(parent, leaf, None)
    return value if isinstance(value, (nn.Module, nn.Parameter)) else None


def prune_optimizer(optimizer, model: nn.Module) -> None:
    """Drop from `optimizer` (a torch optimizer built on the whole model) the parameters this
    stage no longer holds, so they are neither stepped nor kept alive."""
    if optimizer is None:
        return
    keep = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in keep]
    for p in list(optimizer.state):
        if id(p) not in keep:
            del optimizer.state[p]
