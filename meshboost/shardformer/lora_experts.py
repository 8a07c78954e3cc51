"""LoRA adapters on transformers' packed MoE experts (peft's `target_parameters`), sharded with them.

Owns: recognising peft's `ParamWrapper` (one per adapted packed tensor, nested when both the up
projection and `down_proj` are targeted, around the experts module), refusing (pure, before anything
changes, the same on every rank) an adapter meshboost cannot split exactly, and slicing the adapters in
place once their experts are split, with the records that say how.

peft's layout for a packed tensor W `[E, d1, d2]` at rank r: `lora_A` `[E r, in]`, its rows in expert
blocks (row e r + j), and `lora_B` `[out, r E]`, its columns interleaved (column j E + e:
`B.view(out, r, E)[..., e]` is expert e's). Expert e's delta is `B_e A_e` (`[out, in]`) laid over W[e]:
as it is when peft swapped in and out for the `[E, out, in]` layout (`_did_swap_in_out_features`:
Qwen3-MoE, Mixtral, DeepSeek), transposed otherwise (GPT-OSS's `[E, in, out]`). So:

  tensor parallelism (each expert cut on its intermediate dim I, `layers/experts.py`): the factor that
      spans W's split dim is split like it, in its fused blocks ([gate; up] halves, or GPT-OSS's
      interleaved pairs): `lora_B`'s rows for the up projection's 2I, `lora_A`'s columns for down's I.
      The other factor is whole on every rank and its gradient (each rank's part, from its slice of I) is
      summed over tp as it is produced. peft folds `B_e A_e` into this rank's slice of W, which is the
      slice of the adapted weight; merging adds it shard by shard.
  expert parallelism (experts dealt out over ep ranks, `layers/expert_parallel.py`): rank k keeps its
      experts' rows of `lora_A` (one contiguous run) and their columns of `lora_B` (a run in each of its
      r blocks), and the wrapper's `num_experts` becomes the local count. The factors are expert weights
      like the experts they adapt: kind "expert" (averaged over edp), their gradient scaled by 1/ep.

The records say both splits (`TensorParallelInfo.expert_dim` / `expert_blocks` for `lora_B`'s interleaved
columns), so saving, loading and optimizer states gather and cut them like any weight, and the saved
folder is peft's own. Must not know a model family or touch a forward: peft's (a parametrization of the
packed tensor for the length of the call) runs as it is, inside meshboost's experts forward.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
import torch.nn as nn

from meshboost.distributed.param_info import (
    EXPERT,
    GradReduction,
    TensorParallelInfo,
    get_tp_info,
    register_grad_hook,
    set_grad_reduction,
    set_tp_info,
)
from meshboost.shardformer.layers.experts import UP_PARAMS, is_packed_experts
from meshboost.shardformer.layers.linear import shard_parameter_, sum_grad_over_tp

ADAPTED = (*UP_PARAMS, "down_proj")     # the packed tensors whose adapters meshboost splits


def is_expert_adapter(module: nn.Module) -> bool:
    """peft's LoRA wrapper of one parameter (`target_parameters`), checked by class module."""
    return any(c.__module__.startswith("peft.tuners.lora") and c.__name__ == "ParamWrapper"
               for c in type(module).__mro__)


def unwrap(module: nn.Module) -> tuple[list[nn.Module], str, nn.Module]:
    """(peft's wrappers around `module`, outermost first; the path suffix from `module` to what they
    adapt; that module)."""
    wrappers, suffix = [], ""
    while is_expert_adapter(module):
        wrappers.append(module)
        suffix += ".base_layer"
        module = module.base_layer
    return wrappers, suffix, module


def _spans_split(wrapper: nn.Module, split_dim: int) -> str:
    """Which factor ("lora_B" rows or "lora_A" columns) runs along dim `split_dim` (1 or 2) of the
    adapted `[E, d1, d2]` tensor: B's rows are d1 when peft swapped in and out, d2 otherwise."""
    b_dim = 1 if wrapper._did_swap_in_out_features else 2
    return "lora_B" if split_dim == b_dim else "lora_A"


def check_wrappers(path: str, wrappers: list[nn.Module], experts: nn.Module, ep_size: int = 1) -> None:
    """Raise (pure) unless every adapter of `wrappers` on the packed experts `experts` at `path` is in
    the layout meshboost splits: on the up projection or down_proj, factors `[E r, in]` / `[out, r E]`
    matching the tensor's dims; under expert parallelism, no rank left one expert of a transposed tensor
    (peft reads one expert as a plain `[out, in]` matrix and would add it transposed)."""
    if not is_packed_experts(experts):
        raise NotImplementedError(
            f"{path}: peft's target_parameters adapts {[w.parameter_name for w in wrappers]} of "
            f"{type(experts).__name__}, which is not transformers' packed experts (3-D gate_up_proj / up_proj and "
            "down_proj); meshboost splits adapters on packed experts only: leave it out of target_parameters, or "
            "use tp_size=1 and ep_size=1")
    num_experts = experts.down_proj.shape[0]
    for w in wrappers:
        name = w.parameter_name
        if name not in ADAPTED:
            raise NotImplementedError(
                f"{path}.{name}: an adapter on {name} (not a packed expert projection) cannot be split with the "
                f"experts; adapt only {' / '.join(n for n in ADAPTED if hasattr(experts, n))} in target_parameters")
        param = getattr(experts, name)
        for adapter in w.lora_A:
            a, b = w.lora_A[adapter], w.lora_B[adapter]
            r = a.weight.shape[0] // max(num_experts, 1)
            d1, d2 = param.shape[1:]
            out, inp = (d1, d2) if w._did_swap_in_out_features else (d2, d1)
            if (w.num_experts != num_experts or tuple(a.weight.shape) != (r * num_experts, inp)
                    or tuple(b.weight.shape) != (out, r * num_experts) or b.bias is not None):
                raise NotImplementedError(
                    f"{path}.{name}: adapter {adapter!r} has lora_A {tuple(a.weight.shape)}, lora_B "
                    f"{tuple(b.weight.shape)} (num_experts={w.num_experts}) on a {tuple(param.shape)} tensor of "
                    f"{num_experts} experts, not peft's packed-expert layout ([E r, in] / [out, r E]) that meshboost "
                    "knows how to split; use tp_size=1 and ep_size=1 for these adapters")
            if ep_size > 1 and num_experts // ep_size == 1 and not w._did_swap_in_out_features:
                raise NotImplementedError(
                    f"{path}.{name}: ep_size={ep_size} leaves one of the {num_experts} experts per rank, and peft "
                    f"adds a one-expert adapter as a plain [out, in] matrix, which is the transpose of this "
                    f"{type(experts).__name__} layout; choose an ep_size that leaves at least two experts per rank "
                    f"(at most {num_experts // 2})")


def shard_tp_(wrapper: nn.Module, group) -> None:
    """Split `wrapper`'s adapters over the tp `group` like its packed tensor, which `shard_experts_`
    has split (its record says the dim and the fused blocks); the whole factor's gradient is summed."""
    info = get_tp_info(wrapper.get_param())
    if info is None or info.tp_size == 1:
        return
    split = _spans_split(wrapper, info.dim)
    for adapter in wrapper.lora_A:
        a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        sliced, whole = (b, a) if split == "lora_B" else (a, b)
        shard_parameter_(sliced, 0 if split == "lora_B" else 1, group, num_fused=info.num_fused)
        if whole.requires_grad:
            register_grad_hook(whole, partial(sum_grad_over_tp, group))


def expert_wrappers(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(path, wrapper, the packed experts it adapts) of every peft wrapper of `model` on packed experts."""
    return [(path, m, m.get_base_layer()) for path, m in model.named_modules()
            if is_expert_adapter(m) and is_packed_experts(m.get_base_layer())]


def check_ep_adapters(model: nn.Module, ep_size: int) -> None:
    """Refuse (pure) adapters on experts that `ep_size` ranks cannot split with their experts."""
    for path, wrapper, experts in expert_wrappers(model):
        check_wrappers(path, [wrapper], experts, ep_size)


def shard_ep_adapters_(model: nn.Module, group, ep_size: int, ep_rank: int) -> None:
    """Deal the adapters of every expert-parallel experts module of `model` out with their experts
    (after `shard_expert_parallel_`, whose records say the split): rank `ep_rank` keeps its experts'
    rows of lora_A and columns of lora_B, as expert weights."""
    for _, wrapper, experts in expert_wrappers(model):
        base = get_tp_info(wrapper.get_param())
        if base is None or base.expert_size == 1:
            continue
        num_experts = base.full_shape[0]
        local = num_experts // ep_size
        for adapter in wrapper.lora_A:
            a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
            r = a.shape[0] // num_experts
            # the records before slicing (a tp shard's, or a whole factor's: its full shape is its own)
            infos = [get_tp_info(p) or TensorParallelInfo(dim=1 - dim, full_shape=tuple(p.shape),
                                                          padded_size=p.shape[1 - dim], tp_rank=0, tp_size=1)
                     for p, dim in ((a, 0), (b, 1))]
            with torch.no_grad():
                a.data = a.data[ep_rank * local * r:(ep_rank + 1) * local * r].clone()
                b.data = b.data.view(b.shape[0], r, num_experts)[..., ep_rank * local:(ep_rank + 1) * local] \
                    .reshape(b.shape[0], r * local).clone()
            for p, info, dim, blocks in ((a, infos[0], 0, 1), (b, infos[1], 1, r)):
                set_tp_info(p, dataclasses.replace(info, expert_size=ep_size, expert_rank=ep_rank, expert_group=group,
                                                   expert_dim=dim, expert_blocks=blocks))
                set_grad_reduction(p, GradReduction(EXPERT))
                if p.requires_grad:           # the ep ranks' tokens all reached these experts: 1/ep, as theirs
                    register_grad_hook(p, partial(torch.mul, other=1.0 / ep_size))
        wrapper.num_experts = local             # peft views the factors by it

