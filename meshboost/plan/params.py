"""Which parameters, of which local size, one rank of a layout holds: meshboost's own rules, run on
the meta model.

Owns: reading the tensor-parallel split of every parameter (experts included: `expert_splits`; the
whole ones whose gradient is summed over tp marked SUMMED) from the sharder's own validated plan
(`ShardFormer.validate`, the sharder's dry run, on the meta model: the policy's patterns matched
against its module names, the vocab-parallel embedding and LM head, and every refusal the plugin would raise) and the pipeline
stage each parameter lives on (meshboost's `build_stages` run on a meta copy per pipeline rank: the
layers `split_layers` gives it, embeddings on the first stage, tail and heads on the last, tied
weights on both), and the expert-parallel split (`check_expert_parallel`'s experts, dim 0 / ep).
Produces `ParamShard`s: local numel plus the records (`TensorParallelInfo`,
`PipelineTie`) ZeRO's bucketing reads. Must not allocate: everything stays on meta.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshboost.distributed.param_info import (
    EXPERT,
    GradReduction,
    PipelineTie,
    TensorParallelInfo,
    get_pipeline_tie,
    set_grad_reduction,
    set_pipeline_tie,
    set_tp_info,
)

NOT_MODELLED = "not modelled yet"


@dataclass(frozen=True)
class Split:
    """How the sharder splits one parameter over tp (the arguments of `shard_parameter_`)."""

    dim: int
    num_fused: int = 1
    pad_to_multiple: int = 1
    replicas: int = 1
    whole: bool = False         # not split: every rank holds it whole and its gradient is summed over tp


SUMMED = Split(0, whole=True)   # a q/k norm shared by the heads, the experts' down bias: whole, summed over tp


@dataclass
class ParamShard:
    """One parameter as one rank holds it."""

    name: str
    full_numel: int
    numel: int                           # this rank's elements (padding included)
    tp_info: TensorParallelInfo | None
    tie: PipelineTie | None
    shape: tuple[int, ...] = ()          # this rank's local shape (tp and ep splits applied)
    tp_grad_sum: int = 0                 # elements of its gradient all-reduced over tp each backward
    quant: object = None                 # QLoRA: the frozen base's QuantConfig (plan/lora.py's nf4_bytes)

    @property
    def expert(self) -> bool:
        """An expert-parallel weight (its gradient reduced over the experts' own replicas, edp)."""
        return self.tp_info is not None and self.tp_info.expert_size > 1

    def meta_tensor(self) -> torch.Tensor:
        """A meta tensor of this shard's size carrying its records, for ZeRO's `plan_buckets`."""
        t = nn.Parameter(torch.empty(self.numel, device="meta"))
        if self.tp_info is not None:
            set_tp_info(t, self.tp_info)
        if self.tie is not None:
            set_pipeline_tie(t, self.tie)
        if self.expert:
            set_grad_reduction(t, GradReduction(EXPERT))
        return t


def _linear_dims(module: nn.Module) -> tuple[int, int]:
    """(output dim, input dim) of an nn.Linear weight or GPT-2 Conv1D weight."""
    from meshboost.shardformer.layers import is_conv1d
    return (1, 0) if is_conv1d(module) else (0, 1)


def _style_splits(match, tp_size: int) -> dict[int, Split]:
    """id(param) -> Split for the parameters a matched style shards (what the style's apply does)."""
    from meshboost.shardformer.styles import EXPERT_STYLES, head_replicas

    name, module, args = match.style.name, match.module, match.args
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    out: dict[int, Split] = {}
    if name in ("colwise", "colwise_gather", "colwise_fused", "colwise_heads"):
        fused = args[0] if name == "colwise_fused" else 1
        replicas = head_replicas(args[0], tp_size, match.paths[0]) if name == "colwise_heads" else 1
        out[id(weight)] = Split(_linear_dims(module)[0], fused, 1, replicas)
        if bias is not None:
            out[id(bias)] = Split(0, fused, 1, replicas)
    elif name in ("rowwise", "rowwise_split"):
        out[id(weight)] = Split(_linear_dims(module)[1])
    elif name == "head_norm":
        replicas = head_replicas(args[0], tp_size, match.paths[0])
        for p in module.parameters(recurse=False):
            out[id(p)] = Split(0, 1, 1, replicas) if p.dim() == 2 else SUMMED
    elif name == "replicated_grad_allreduce":
        out.update({id(p): SUMMED for p in module.parameters(recurse=False)})
    elif name == "embedding_heads":
        out[id(weight)] = Split(1)
    elif name in EXPERT_STYLES:          # what shard_experts_ splits (layers/experts.py)
        from meshboost.shardformer.layers.experts import expert_splits
        split = expert_splits(module, interleaved=name == EXPERT_STYLES[1])
        for pname, p in module.named_parameters(recurse=False):
            out[id(p)] = Split(*split[pname]) if pname in split else SUMMED     # the down bias: whole
    elif name not in ("block_input", "heads_bias", "vocab_embedding"):
        raise NotImplementedError(f"{match.paths[0]}: sharding style {name!r} is {NOT_MODELLED} by the planner")
    return out


def tp_splits(model: nn.Module, tp_size: int, make_vocab_size_divisible_by: int = 64) -> dict[int, Split]:
    """id(param) -> Split for every parameter tensor parallelism splits in `model` (meta), read from the
    sharder's own validated plan; raises what the plugin raises for a model it cannot shard."""
    if tp_size == 1:
        return {}
    from meshboost.shardformer import ShardConfig, ShardFormer
    from meshboost.shardformer.policies import get_policy

    policy = get_policy(model)
    plan = ShardFormer(ShardConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by)).validate(
        model, policy, tp_size)
    splits: dict[int, Split] = {}
    for match in plan.matches:
        if match.style.name == "vocab_embedding":
            splits[id(match.module.weight)] = Split(0, 1, make_vocab_size_divisible_by)
        else:
            splits.update(_style_splits(match, tp_size))
    for path, param, style, _ in plan.params:
        if style.name != "split_heads":
            raise NotImplementedError(f"{path}: parameter style {style.name!r} is {NOT_MODELLED} by the planner")
        splits[id(param)] = Split(0)
    for paths in plan.embedding_paths + plan.head_paths:
        module = model.get_submodule(paths[0])
        splits[id(module.weight)] = Split(0, 1, make_vocab_size_divisible_by)
        if getattr(module, "bias", None) is not None:
            splits[id(module.bias)] = Split(0, 1, make_vocab_size_divisible_by)
    if plan.adapters:                   # peft LoRA layers on sharded linears: split with their base (plan/lora.py)
        from meshboost.plan.lora import adapter_splits
        splits.update(adapter_splits(plan, splits))
    return splits


def tp_info(shape: tuple[int, ...], split: Split, tp_rank: int, tp_size: int) -> TensorParallelInfo:
    """The record `shard_parameter_` would attach (padded size by its rule)."""
    dim, size = split.dim % len(shape), shape[split.dim % len(shape)]
    shards = tp_size // split.replicas
    multiple = split.pad_to_multiple * shards if split.pad_to_multiple > 1 else shards
    padded = -(-size // multiple) * multiple if split.pad_to_multiple > 1 else size
    return TensorParallelInfo(dim=dim, full_shape=tuple(shape), padded_size=padded, tp_rank=tp_rank,
                              tp_size=tp_size, num_fused=split.num_fused, replicas=split.replicas)


def stage_holdings(model: nn.Module, pp_size: int, num_chunks: int = 1,
                   num_layers_per_stage: list[int] | None = None) -> list[dict[str, PipelineTie | None]]:
    """Per pipeline rank: {parameter name (the model's first name for it): its PipelineTie or None}, from
    meshboost's `build_stages` run on a meta copy of `model` for each rank."""
    names = [n for n, _ in model.named_parameters()]
    if pp_size == 1:
        return [{n: None for n in names}]
    from meshboost.pipeline import build_stages
    from meshboost.shardformer import pipeline_layout

    layout = pipeline_layout(model)
    layers = _layer_modules(model, layout)
    out = []
    for rank in range(pp_size):
        # the layers are shared with `model`, the rest copied: a cut replaces the layer lists, reading the
        # layers it drops and changing none (a layer's weights are tied over ranks only in shared groups)
        cut = copy.deepcopy(model, {id(m): m for m in layers})
        first_name = {id(p): n for n, p in cut.named_parameters()}
        if list(first_name.values()) != names:      # a weight reached from a layer and from outside it: whole
            cut = copy.deepcopy(model)
            first_name = {id(p): n for n, p in cut.named_parameters()}
        build_stages(cut, rank, pp_size, num_chunks, num_layers_per_stage, layout=layout)
        out.append({first_name[id(p)]: get_pipeline_tie(p) for p in cut.parameters()})
    return out


def _layer_modules(model: nn.Module, declared) -> list[nn.Module]:
    """The layers of the lists a pipeline cut replaces, which a copy for one cut may share with `model`;
    none where a segment loops over shared layer groups (their weights are tied across ranks: a cut
    marks them)."""
    from meshboost.pipeline.layout import get_layout

    base = getattr(model, "base_model", model)
    segments = get_layout(model, declared).segments
    if any(segment.shared_groups for segment in segments):
        return []
    return [m for segment in segments for m in base.get_submodule(segment.layers)]


def expert_params(model: nn.Module, ep_size: int) -> set[int]:
    """id(param) of every expert weight `ep_size` ranks split (meshboost's `check_expert_parallel`:
    its refusals are the plugin's); empty at ep_size 1."""
    if ep_size == 1:
        return set()
    from meshboost.shardformer.layers.expert_parallel import check_expert_parallel
    return {id(p) for _, module in check_expert_parallel(model, ep_size) for p in module.parameters(recurse=False)}


class RankShards(list):
    """One rank's trainable `ParamShard`s (what gradients, masters, optimizer states and ZeRO's buckets
    are made of) and, as `frozen`, the parameters it holds that train nothing (LoRA's base weights:
    working weights only, no gradient, master or state)."""

    frozen: list = []
    frozen_inputs: int = 0          # column-parallel blocks whose input gradient is never computed (plan/lora.py)


def rank_shards(model: nn.Module, splits: dict[int, Split], held: dict[str, PipelineTie | None], tp_rank: int,
                tp_size: int, experts: set[int] = frozenset(), ep_size: int = 1) -> RankShards:
    """The trainable parameters one (pp, tp, ep) rank holds, in the order of `model.parameters()` (the
    order of an optimizer built on it, and so of ZeRO's buckets), with its frozen ones as `frozen`.
    `experts`: the ids `expert_params` gives, each split on dim 0 into ep_size runs of experts, after
    the tp split (`shard_expert_parallel_`'s record; every ep rank holds as many)."""
    out, frozen = RankShards(), []
    for name, p in model.named_parameters():
        if name not in held:
            continue
        split = splits.get(id(p))
        shape = tuple(p.shape)
        info = tp_info(shape, split, tp_rank, tp_size) if split is not None and not split.whole else None
        local = list(shape)
        summed = p.numel() if split is not None and split.whole else 0
        if info is not None:
            local[info.dim] = info.local_size
            if info.replicas > 1:        # `_sum_over_replicas`: one all-reduce of [num_shards, *local]
                summed = info.num_shards * math.prod(local)
        if id(p) in experts:
            info = info or TensorParallelInfo(dim=p.dim() - 1, full_shape=shape, padded_size=shape[-1], tp_rank=0,
                                              tp_size=1)
            info = dataclasses.replace(info, expert_size=ep_size)
            local[0] //= ep_size
        numel = math.prod(local)
        shard = ParamShard(name, p.numel(), numel, info, held[name], tuple(local), summed if p.requires_grad else 0)
        (out if p.requires_grad else frozen).append(shard)
    out.frozen = frozen
    if frozen and tp_size > 1:
        from meshboost.plan.lora import frozen_inputs
        out.frozen_inputs = frozen_inputs(model, splits, held)
    return out
