"""A policy read from transformers' own `config.base_model_tp_plan` (Llama, Qwen2, Mistral, ...).

Only transformers styles whose numbers equal one of ours are translated (`TRANSFORMERS_STYLES`, and
`moe_tp_experts` with its packed parameters' entries: `layers/experts.py`; from transformers 5.25 the
experts module is named only by `base_model_ep_plan`'s `ep_dispatch_experts`); anything else (MLA,
identity experts, ...) is refused with an error naming it rather than guessed. A
module with two or more column-parallel children (q/k/v, gate/up) becomes a block input, so its
input gradient is all-reduced once (the sharder drops it where another linear, such as an MoE
router, also reads that input). The pipeline layout is left to transformers' `base_model_pp_plan`.
"""

from __future__ import annotations

from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.styles import BLOCK_INPUT, MOE_EXPERTS, kv_groups

# transformers plan style -> the meshboost style that computes the same numbers
TRANSFORMERS_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",            # GLM's gate_up, OLMo2's q/k/v (whole-hidden q/k norm)
    "rowwise_split_input": "rowwise_split",               # after a gathered column output
    "replicated_with_grad_allreduce": "replicated_grad_allreduce",    # Qwen3's per-head q/k norm
    "embedding_rowwise": "vocab_embedding",               # GPT-NeoX's embed_in: the input embedding
}
# The experts module's style: its packed parameters' entries (packed_colwise / packed_rowwise on
# gate_up_proj, rowwise / colwise on down_proj) are its layout, checked and split by it.
EXPERTS_STYLE = "moe_tp_experts"
# transformers >= 5.25 names the experts module only in `base_model_ep_plan` (its tp plans dropped the
# `moe_tp_experts` entries): the module that plan dispatches to is the one meshboost splits under tp
EP_EXPERTS_STYLE = "ep_dispatch_experts"
# Styles refused with a reason: meshboost does not shard these yet.
NOT_SUPPORTED = {
    "moe_identity_expert": "MoE identity experts",
    "packed_colwise": "packed projections outside an experts module",
    "packed_rowwise": "packed projections outside an experts module",
    "mla_kv_a_proj": "multi-head latent attention's kv_a projection", "local_params": "local parameters",
    "replicate": "explicitly replicated modules", "all_reduce": "all-reduced module outputs",
    "embedding_colwise": "embeddings split by hidden dimension",
}
_DIVISIBLE = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
_KV_PROJECTIONS = ("k_proj", "v_proj")


def policy_from_tp_plan(config, tp_plan: dict | None = None) -> Policy | None:
    """Build a Policy from `config.base_model_tp_plan` (or `tp_plan`, another family's plan for the
    same layers), or None when there is no plan."""
    tp_plan = tp_plan if tp_plan is not None else getattr(config, "base_model_tp_plan", None)
    if not tp_plan:
        return None
    plan: dict[str, str] = {}
    colwise_parents: dict[str, int] = {}
    experts = {pattern for pattern, style in tp_plan.items() if style == EXPERTS_STYLE}
    if not experts:         # the experts left out of the tp plan would stay whole on every tp rank
        ep_plan = getattr(config, "base_model_ep_plan", None) or {}
        experts = {pattern for pattern, style in ep_plan.items() if style == EP_EXPERTS_STYLE}
        plan.update({pattern: MOE_EXPERTS for pattern in experts})
    for pattern, style in tp_plan.items():
        if pattern in experts:
            plan[pattern] = MOE_EXPERTS
            continue
        if pattern.rsplit(".", 1)[0] in experts:       # an experts module's packed parameter: its layout
            continue
        if style not in TRANSFORMERS_STYLES:
            what = f" ({NOT_SUPPORTED[style]})" if style in NOT_SUPPORTED else ""
            raise ValueError(
                f"{type(config).__name__}.base_model_tp_plan entry {pattern!r}: {style!r}{what} is not supported by "
                f"meshboost's generic policy (it reads {sorted(TRANSFORMERS_STYLES)}); use tp_size=1 (pipeline and "
                "data parallelism need no plan) or pass custom_policy=Policy(...)")
        plan[pattern] = TRANSFORMERS_STYLES[style]
        if plan[pattern] == "colwise":        # a gathered output may read anything: never a block input
            parent = pattern.rsplit(".", 1)[0]
            colwise_parents[parent] = colwise_parents.get(parent, 0) + 1
    for parent, count in colwise_parents.items():
        if count >= 2:
            plan[parent] = BLOCK_INPUT
    divisible = tuple(f for f in _DIVISIBLE if getattr(config, f, None) is not None)
    attributes = {}
    heads, kv = getattr(config, "num_attention_heads", None), getattr(config, "num_key_value_heads", None)
    kv_paths = [p for p, style in plan.items() if style == "colwise" and p.rsplit(".", 1)[-1] in _KV_PROJECTIONS]
    if isinstance(kv, int) and isinstance(heads, int) and kv < heads and kv_paths:
        # Grouped-query attention: key/value heads may be fewer than tp (each then held by the ranks
        # whose query heads use it); the attention module's query heads per kv head follow.
        for p in kv_paths:
            plan[p] = f"colwise_heads({kv})"
        for parent in {p.rsplit(".", 1)[0] for p in kv_paths}:
            attributes[parent] = {"num_key_value_groups": kv_groups(kv)}
        divisible = tuple(f for f in divisible if f != "num_key_value_heads")
    if getattr(config, "use_qk_norm", False) is True:
        _add_head_norms(plan, heads, kv)
    return Policy(name=f"tp_plan:{config.model_type}", plan=plan, attributes=attributes, divisible=divisible)


def _add_head_norms(plan: dict[str, str], heads, kv) -> None:
    """With `use_qk_norm` (Cohere), a q/k norm next to a column-parallel q/k projection that the plan
    does not name sees only this rank's heads: split it by heads (or sum its gradient) rather than
    leave its weight whole and its gradient partial. Only for that flag: other per-head parameters
    (Doge's) stay refused by the split-input guard. An entry matching no module is harmless."""
    if not isinstance(heads, int):
        return
    for pattern, style in list(plan.items()):
        parent, _, leaf = pattern.rpartition(".")
        if leaf in ("q_proj", "k_proj") and (style == "colwise" or style.startswith("colwise_heads(")):
            norm = f"{parent}.{leaf[0]}_norm"
            count = heads if leaf == "q_proj" or not isinstance(kv, int) else kv
            plan.setdefault(norm, f"head_norm({count})")
