"""ColossalAI's `shardformer.policies.auto_policy.get_autopolicy(model)`: the policy meshboost picks for
`model` by itself (its family's table, or the model's own `base_model_tp_plan`), for a script that passes it on
as `HybridParallelPlugin(custom_policy=get_autopolicy(model))` (ColossalChat's reward-model, PPO and GRPO
scripts). A thin view of `meshboost.shardformer.policies.get_policy`: a model no policy covers raises its
ValueError (ColossalAI raises NotImplementedError; both name the supported models). A peft model is looked up
through its base model, as ColossalAI does."""

from __future__ import annotations

import torch.nn as nn

from meshboost.shardformer.policies import Policy, get_policy

__all__ = ["get_autopolicy"]


def get_autopolicy(model: nn.Module) -> Policy:
    """The meshboost `Policy` that shards `model` when no custom policy is given."""
    base = getattr(model, "get_base_model", None)      # peft: the wrapped transformers model
    return get_policy(base() if callable(base) else model)
