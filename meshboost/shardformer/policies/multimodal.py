"""Policies for composite models (vision-language: Qwen2.5-VL, Qwen3-VL, LLaVA, Gemma-3, Idefics3 /
SmolVLM, PaliGemma, ...) whose top-level config ships no `base_model_tp_plan` while a sub-config does.

Owns: finding, under the base model, the module each sub-config belongs to (the module whose
`.config` is that sub-config object, as transformers builds them), prefixing the sub-config's plan
(read by `policy_from_tp_plan`) with that module's path, and checking the sub-config's divisible
fields. A sub-model without a plan of its own (every vision tower in transformers 5) stays
replicated, which is exact: it reads the same pixels on every tp rank, its output joins the whole
embeddings, and the gradient it receives is the whole one on every rank (each layer's Megatron f
sums it), so its weights' gradients are equal on every rank with no collective. That choice is said
once (rank 0), as it costs the tower's memory on every rank. Must not know a model family.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.policies.tp_plan import policy_from_tp_plan


def _sub_configs(config) -> dict:
    """transformers' own declaration of a composite config's parts (`sub_configs`), the built ones."""
    return {name: getattr(config, name) for name in getattr(config, "sub_configs", {})
            if getattr(config, name, None) is not None}


def _path_of(base: nn.Module, sub_config) -> str | None:
    """The shortest path under `base` to a module built from `sub_config` (the same object)."""
    paths = [name for name, module in base.named_modules() if name and getattr(module, "config", None) is sub_config]
    return min(paths, key=lambda p: p.count(".")) if paths else None


def layer_plan(sub, layer_plans: dict) -> dict | None:
    """The config's plan completed with the layers of the family it names in `layer_plans` (None: its
    own plan stands)."""
    donor = layer_plans.get(getattr(sub, "model_type", None))
    if donor is None:
        return None
    from transformers import AutoConfig

    return {**(getattr(sub, "base_model_tp_plan", None) or {}), **AutoConfig.for_model(donor).base_model_tp_plan}


def _divisible_check(fields: list[tuple[str, object, str]]):
    def check(config, tp_size: int) -> None:
        for where, sub, field in fields:
            value = getattr(sub, field, None)
            if isinstance(value, int) and value % tp_size:
                raise ValueError(f"{type(config).__name__}: {where}.{field}={value} is not divisible by "
                                 f"tp_size={tp_size}; choose a tp_size that divides {value}")
    return check


def multimodal_policy(model: nn.Module, layer_plans: dict | None = None) -> Policy | None:
    """The composite model's policy from its sub-configs' plans, or None when none ships one.
    layer_plans: sub-config model_type -> the model_type whose shipped plan its layers share, for a
    sub-config shipping a plan that leaves its layers whole (the registry's table, data)."""
    config = getattr(model, "config", None)
    subs = _sub_configs(config) if config is not None else {}
    if not subs:
        return None
    base = model.base_model
    plan: dict[str, str] = {}
    attributes: dict[str, dict] = {}
    fields: list[tuple[str, object, str]] = []
    replicated: list[str] = []
    for name, sub in subs.items():
        sub_policy = policy_from_tp_plan(sub, layer_plan(sub, layer_plans or {}))
        path = _path_of(base, sub)
        if sub_policy is None:
            if path is not None:
                replicated.append(f"{path} ({name})")
            continue
        if path is None:
            raise ValueError(f"{type(model).__name__}: config.{name} ships a tensor-parallel plan but no module under "
                             f"{type(base).__name__} is built from it, so its paths cannot be placed; pass "
                             "custom_policy=Policy(...) or use tp_size=1")
        plan.update({f"{path}.{pattern}": style for pattern, style in sub_policy.plan.items()})
        attributes.update({f"{path}.{pattern}": rules for pattern, rules in sub_policy.attributes.items()})
        fields += [(f"config.{name}", sub, f) for f in sub_policy.divisible]
    if not plan:
        return None
    return Policy(name=f"tp_plan:{config.model_type}", plan=plan, attributes=attributes, divisible=(),
                  check=_divisible_check(fields), replicated=tuple(replicated))
