"""DeepSeek-V2 / V3 (`DeepseekV2Model`, `DeepseekV3Model`, their `ForCausalLM`): multi-head latent
attention (MLA) split by heads, plus the MLP entries of transformers' own `base_model_tp_plan`
(read by `policy_from_tp_plan`). Paths are relative to the base model.

transformers' plan names no attention module for DeepSeek-V3 (and a `mla_kv_a_proj` style for V2),
so the generic policy would leave MLA whole on every rank. MLA per layer:
    q   = q_b_proj(q_a_layernorm(q_a_proj(x)))          (q_proj(x) when q_lora_rank is None)
    c   = kv_a_proj_with_mqa(x) = [kv_nope | k_pe]      (k_pe: one rotary key shared by all heads)
    k,v = kv_b_proj(kv_a_layernorm(kv_nope)) per head, with k_pe appended to every head's key
    out = o_proj(attention over the heads)
The head-split projections (q_b_proj / q_proj, kv_b_proj: output features heads x per-head dims,
head-major) are colwise, o_proj rowwise (Megatron's g: its all-reduce). q_a_proj,
kv_a_proj_with_mqa and the two a-layernorms are shared by all heads and stay whole.

Where Megatron's f goes: each rank's backward reaches the replicated part only through its own heads
(q_b_proj's and kv_b_proj's input gradients, and k_pe's, which each rank's heads use), so every
gradient in the replicated part is that rank's share of the true one. The attention is a block
input: f once at its input, so the gradient of x (the sum over paths and heads) is all-reduced once;
the replicated modules' own parameters get 'replicated_grad_allreduce' (their gradients summed over
tp once, as they are produced), through 'replicated_in_block_input', which refuses the model when the
sharder dropped the block input (that sum would then count the gradient tp times). The column-parallel
projections inside the block apply no f of their
own (their role comes from the block's region), so nothing is summed twice. Under sequence
parallelism the block's f is the sequence all-gather, whose backward reduce-scatter is the same sum.

Per rank, the attention module's `num_heads` is divided; its reshapes use -1 for the head count,
and `num_key_value_groups` (query heads per key/value head, a ratio) is unchanged.
"""

from __future__ import annotations

import copy
import dataclasses

from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.policies.tp_plan import policy_from_tp_plan
from meshboost.shardformer.styles import (
    BLOCK_INPUT,
    STYLES,
    ShardContext,
    register_style,
)

SHARED = "replicated_in_block_input"   # registered below


def _shared(ctx: ShardContext, path: str, module) -> None:
    """'replicated_grad_allreduce' (the module stays whole; its gradient is summed over tp), which is
    exact only while the enclosing attention applies Megatron's f once at its input, so that no
    column-parallel projection behind this module applies another (its input gradient would then be
    whole already, and the sum would give tp times the gradient). The sharder drops a block input
    whose block holds a linear the plan does not cover: refuse that rather than compute it."""
    parent = path.rpartition(".")[0]
    region = ctx.regions.enclosing(path)
    if region is None or region.path != parent:
        raise ValueError(f"{path}: a module shared by all heads of {parent} needs {parent} to be a block input "
                         "(Megatron's f once at its input), which the sharder dropped: it holds a linear the plan "
                         "does not cover; add that module to the policy's plan")
    return STYLES["replicated_grad_allreduce"].apply(ctx, path, module)


register_style(SHARED, STYLES["replicated_grad_allreduce"].validate, _shared)

ATTENTION = "layers.*.self_attn"
ATTENTION_PLAN = {
    ATTENTION: BLOCK_INPUT,                                     # f once for everything reading x
    f"{ATTENTION}.q_proj": "colwise",                           # q_lora_rank None
    f"{ATTENTION}.q_b_proj": "colwise",
    f"{ATTENTION}.kv_b_proj": "colwise",
    f"{ATTENTION}.o_proj": "rowwise",
    f"{ATTENTION}.q_a_proj": SHARED,                           # shared by all heads: gradient summed over tp
    f"{ATTENTION}.q_a_layernorm": SHARED,
    f"{ATTENTION}.kv_a_proj_with_mqa": SHARED,
    f"{ATTENTION}.kv_a_layernorm": SHARED,
}
ATTENTION_ATTRIBUTES = {ATTENTION: {"num_heads": "divide"}}
_MOE_MODULES = ("layers.*.mlp.experts", "layers.*.mlp.shared_experts")


def _has_moe_layers(config) -> bool:
    """Layers from `first_k_dense_replace` on hold an MoE block (V2 and V3 alike)."""
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    return config.num_hidden_layers > first_dense


def _mlp_policy(config) -> Policy | None:
    """transformers' plan without its attention entries (this table's), read by the generic policy.
    With no MoE layer in the model, the expert entries (which would match nothing) are left out too,
    so a dense-only model does not depend on the generic policy reading MoE styles."""
    plan = {k: v for k, v in (type(config).base_model_tp_plan or {}).items() if not k.startswith(ATTENTION + ".")}
    if not _has_moe_layers(config):
        plan = {k: v for k, v in plan.items() if not any(k == m or k.startswith(m + ".") for m in _MOE_MODULES)}
    view = copy.copy(config)          # the same config seen with that plan; the model's config is untouched
    view.base_model_tp_plan = plan
    if not _has_moe_layers(config):   # nor its ep plan's experts (which name the experts from transformers 5.25)
        view.base_model_ep_plan = {}
    return policy_from_tp_plan(view) if plan else None


def _check(config, tp_size: int) -> None:
    heads = config.num_attention_heads
    if not isinstance(heads, int) or heads <= 0 or heads % tp_size:
        raise ValueError(f"{type(config).__name__}.num_attention_heads={heads!r} is not divisible by "
                         f"tp_size={tp_size}: multi-head latent attention is split by heads, so choose a tp_size "
                         f"that divides {heads}")


def uses_deepseek_attention(config) -> bool:
    """The config's own plan names DeepSeek's latent attention at this table's path (transformers' MLA
    style on `kv_a_proj_with_mqa`): a family built on DeepSeek's layers (AXK1, Sarvam-MLA) gets this table."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    return plan.get(f"{ATTENTION}.kv_a_proj_with_mqa") == "mla_kv_a_proj"


def deepseek_policy(config) -> Policy:
    """The DeepSeek-V2/V3 table for `config`: MLA by heads, the MLP entries from transformers' plan
    (raising, as the generic policy does, for MoE styles it cannot read yet)."""
    mlp = _mlp_policy(config)
    plan = {**(mlp.plan if mlp else {}), **ATTENTION_PLAN}
    attributes = {**(mlp.attributes if mlp else {}), **ATTENTION_ATTRIBUTES}
    # num_key_value_heads is no split of MLA (kv_b_proj makes num_heads heads): not required to divide
    divisible = tuple(f for f in (mlp.divisible if mlp else ("num_attention_heads",)) if f != "num_key_value_heads")
    mlp_check = mlp.check if mlp else None

    def check(cfg, tp_size: int) -> None:
        _check(cfg, tp_size)
        if mlp_check is not None:
            mlp_check(cfg, tp_size)

    base = mlp or Policy(name="", plan=ATTENTION_PLAN)
    return dataclasses.replace(base, name=config.model_type, plan=plan, attributes=attributes,
                               divisible=divisible, check=check)
