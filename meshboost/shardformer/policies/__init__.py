"""Policy registry: model family (config.model_type) -> Policy, with transformers' own
`base_model_tp_plan` as the fallback (Llama, Qwen2, Mistral, ... need no table of their own)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections.abc import Mapping
from typing import Callable, Iterator

import torch.nn as nn

from meshboost.shardformer.mixers import mixer_kind
from meshboost.shardformer.policies.base import Policy, pattern_to_regex, plan_root
from meshboost.shardformer.policies.deepseek import deepseek_policy, uses_deepseek_attention
from meshboost.shardformer.policies.gpt_oss import gpt_oss_policy
from meshboost.shardformer.policies.multimodal import layer_plan, multimodal_policy
from meshboost.shardformer.policies.tp_plan import policy_from_tp_plan

# model_type -> (module beside this file, the table's name in it). A table's module is imported when a
# model of its family is looked up, not with meshboost: Falcon's registers transformers' FalconLinear,
# which imports the family's modeling module (and with it transformers.modeling_utils).
_TABLES: dict[str, tuple[str, str]] = {
    "bert": ("bert", "BERT_POLICY"), "gpt2": ("gpt2", "GPT2_POLICY"), "opt": ("opt", "OPT_POLICY"),
    "bloom": ("bloom", "BLOOM_POLICY"), "falcon": ("falcon", "FALCON_POLICY"), "vit": ("vit", "VIT_POLICY"),
    "albert": ("albert", "ALBERT_POLICY"), "t5": ("t5", "T5_POLICY"), "whisper": ("whisper", "WHISPER_POLICY"),
    "blip-2": ("blip2", "BLIP2_POLICY"), "esmc": ("esmc", "ESMC_POLICY"),
}


class _FamilyTables(Mapping):
    """model_type -> Policy, each family's module imported on first lookup."""

    def __getitem__(self, model_type: str) -> Policy:
        module, name = _TABLES[model_type]
        policy = getattr(importlib.import_module(f"{__name__}.{module}"), name)
        return policy

    def __iter__(self) -> Iterator[str]:
        return iter(_TABLES)

    def __len__(self) -> int:
        return len(_TABLES)


POLICIES: Mapping[str, Policy] = _FamilyTables()
# Families whose table depends on the config (model_type -> callable(config) -> Policy): DeepSeek's
# multi-head latent attention combined with the MLP entries of transformers' own plan; GPT-OSS, whose
# shipped plan splits only the embedding.
POLICY_BUILDERS: dict[str, Callable] = {"deepseek_v2": deepseek_policy, "deepseek_v3": deepseek_policy,
                                        "gpt_oss": gpt_oss_policy}
# A vision-language model's text sub-config whose shipped plan splits only its embedding, and the text
# family whose decoder layers (and plan) it shares: Qwen3-VL's text model is Qwen3's (per-head q/k norms).
LAYER_PLANS: dict[str, str] = {"qwen3_vl_text": "qwen3"}


def _model_type(model: nn.Module):
    return getattr(getattr(model, "config", None), "model_type", None)


def get_policy(model: nn.Module) -> Policy:
    """The policy for `model`, or a ValueError naming the supported families and the way out; its recurrent
    mixers (Gated DeltaNet, Mamba2) split by heads where `mixers.py` knows their shape."""
    policy = _family_policy(model)      # first: a model no policy covers is refused naming the way out
    return split_mixers(plan_root(model), policy)


def _family_policy(model: nn.Module) -> Policy:
    model_type = _model_type(model)
    if model_type in POLICIES:
        return POLICIES[model_type]
    config = getattr(model, "config", None)
    if model_type in POLICY_BUILDERS and config is not None:
        return POLICY_BUILDERS[model_type](config)
    if uses_deepseek_attention(config):      # DeepSeek's MLA in another family (from transformers 5.25's plans)
        return deepseek_policy(config)
    policy = policy_from_tp_plan(config, layer_plan(config, LAYER_PLANS)) if config is not None else None
    if policy is None:          # a composite (vision-language) model: its sub-configs' plans, placed
        policy = multimodal_policy(model, LAYER_PLANS)
    if policy is not None:
        return policy
    raise ValueError(
        f"no tensor-parallel policy for {type(model).__name__} (model_type={model_type!r}). Supported: "
        f"{sorted(POLICIES)} and models whose config (or a sub-config: the language model of a vision-language "
        "model) ships a `base_model_tp_plan` meshboost can read (Llama, Qwen2, Mistral, Gemma, Qwen2.5-VL, LLaVA, "
        "...: docs/models.md). Pass custom_policy=meshboost.shardformer.Policy(name=..., "
        "plan={'layers.*.q_proj': 'colwise', ...}) to HybridParallelPlugin or ShardFormer.optimize(), or use "
        "tp_size=1 (pipeline and data parallelism need no policy).")


def split_mixers(root: nn.Module, policy: Policy) -> Policy:
    """`policy` with every recurrent mixer under `root` (the plan's root) that `mixers.py` can split given its
    style, and the plan's entries inside those mixers dropped (the style shards them). A layer pattern naming
    other modules too (Nemotron-H's `layers.*.mixer` is a Mamba2 mixer, an attention or an MoE by layer) gives
    way to each mixer's own path; a mixer another entry reaches into stays whole. Pure."""
    modules = dict(root.named_modules())
    kinds = {name: mixer_kind(m) for name, m in modules.items() if name and "A_log" in m._parameters}
    kinds = {name: kind for name, kind in kinds.items() if kind is not None}
    entries: dict[str, str | None] = {}
    for name, kind in kinds.items():
        pattern = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)
        regex = pattern_to_regex(pattern)
        same = all(kinds.get(other) == kind for other in modules if other and regex.match(other))
        entries[pattern if same else name] = kind
    plan = {p: s for p, s in policy.plan.items() if not any(p == e or p.startswith(e + ".") for e in entries)}
    regexes = [pattern_to_regex(p) for p in plan]
    for entry in list(entries):
        inner = [n for n in modules if n.startswith(entry + ".")] if "*" not in entry else []
        if any(r.match(n) for r in regexes for n in inner):
            entries[entry] = None             # another entry shards part of it: left whole (the sweep says so)
    entries = {e: kind for e, kind in entries.items() if kind is not None}
    # first: a layer pattern the plan also gives (a block input for an attention under the same name) loses
    return dataclasses.replace(policy, plan={**entries, **plan}) if entries else policy


def pipeline_layout(model: nn.Module, custom_policy: Policy | None = None) -> dict | None:
    """The pipeline layout a family's table declares (the custom policy's first), or None to let the
    pipeline read transformers' `base_model_pp_plan`. Never raises: pipeline stages need no
    tensor-parallel policy."""
    if custom_policy is not None and custom_policy.pipeline_layout is not None:
        return custom_policy.pipeline_layout
    policy = POLICIES.get(_model_type(model))
    return policy.pipeline_layout if policy is not None else None


__all__ = ["Policy", "POLICIES", "POLICY_BUILDERS", "get_policy", "pipeline_layout", "policy_from_tp_plan"]
