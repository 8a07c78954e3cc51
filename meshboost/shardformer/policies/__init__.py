"""Policy registry: model family (config.model_type) -> Policy, with transformers' own
`base_model_tp_plan` as the fallback."""

from __future__ import annotations

import torch.nn as nn

from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.policies.bert import BERT_POLICY
from meshboost.shardformer.policies.gpt2 import GPT2_POLICY
from meshboost.shardformer.policies.llama import LLAMA_POLICY
from meshboost.shardformer.policies.tp_plan import policy_from_tp_plan

POLICIES: dict[str, Policy] = {"bert": BERT_POLICY, "gpt2": GPT2_POLICY, "llama": LLAMA_POLICY}


def get_policy(model: nn.Module) -> Policy:
    """The policy for `model`, or a ValueError naming the supported families and the way out."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type in POLICIES:
        return POLICIES[model_type]
    policy = policy_from_tp_plan(config) if config is not None else None
    if policy is not None:
        return policy
    raise ValueError(
        f"no tensor-parallel policy for {type(model).__name__} (model_type={model_type!r}). Supported: "
        f"{sorted(POLICIES)} and any model whose config ships `base_model_tp_plan` (Llama, Qwen2, Mistral, "
        "...). Pass custom_policy=meshboost.shardformer.Policy(name=..., plan={'layers.*.q_proj': 'colwise', "
        "...}) to HybridParallelPlugin or ShardFormer.optimize().")


__all__ = ["Policy", "POLICIES", "get_policy", "policy_from_tp_plan"]
