"""A policy read from transformers' own `config.base_model_tp_plan` (Llama, Qwen2, Mistral, ...).

Only transformers styles whose meaning equals one of ours are translated (`TRANSFORMERS_STYLES`);
anything else (e.g. "local_rowwise", "sequence_parallel") is refused with an error rather than
guessed. A module with two or more column-parallel children (q/k/v, gate/up) becomes a block input,
so its input gradient is all-reduced once. The pipeline layout is left to transformers'
`base_model_pp_plan`.
"""

from __future__ import annotations

from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.styles import BLOCK_INPUT

# transformers plan style -> meshboost style with the same numbers
TRANSFORMERS_STYLES = {"colwise": "colwise", "rowwise": "rowwise"}
_DIVISIBLE = ("num_attention_heads", "num_key_value_heads", "intermediate_size")


def policy_from_tp_plan(config) -> Policy | None:
    """Build a Policy from `config.base_model_tp_plan`, or None when the config has no plan."""
    tp_plan = getattr(config, "base_model_tp_plan", None)
    if not tp_plan:
        return None
    plan: dict[str, str] = {}
    colwise_parents: dict[str, int] = {}
    for pattern, style in tp_plan.items():
        if style not in TRANSFORMERS_STYLES:
            raise ValueError(
                f"{type(config).__name__}.base_model_tp_plan entry {pattern!r}: {style!r} is not supported by "
                f"meshboost's generic policy (only {sorted(TRANSFORMERS_STYLES)}); pass custom_policy=Policy(...)")
        plan[pattern] = TRANSFORMERS_STYLES[style]
        if plan[pattern] == "colwise":
            parent = pattern.rsplit(".", 1)[0]
            colwise_parents[parent] = colwise_parents.get(parent, 0) + 1
    for parent, count in colwise_parents.items():
        if count >= 2:
            plan[parent] = BLOCK_INPUT
    divisible = tuple(f for f in _DIVISIBLE if getattr(config, f, None) is not None)
    return Policy(name=f"tp_plan:{config.model_type}", plan=plan, divisible=divisible)
