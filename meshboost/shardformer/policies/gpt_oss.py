"""GPT-OSS (`GptOssForCausalLM`): attention (with its per-head sinks) and experts split over tp.

transformers' plan for gpt_oss names only `embed_tokens`, so the generic policy left attention and
every expert whole on every rank (95% of the parameters). This table: the attention is a block input
(Megatron's f once), q by heads, k/v by key/value heads (held by the ranks whose query heads use
them when fewer than tp), o rowwise, and the `sinks` (one learned logit per head, concatenated to
that head's attention scores) split with the heads; the experts split inside every expert
(`moe_experts_interleaved`: GPT-OSS's gate and up rows alternate, and both projections carry
biases; layers/experts.py); the router (weight and bias) replicated; embedding and LM head
vocab-parallel. Sliding-window and full layers are alike here.
"""

from __future__ import annotations

from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.styles import BLOCK_INPUT, EXPERT_STYLES, kv_groups

ATTENTION = "layers.*.self_attn"


def gpt_oss_policy(config) -> Policy:
    kv = config.num_key_value_heads
    plan = {
        ATTENTION: BLOCK_INPUT,
        f"{ATTENTION}.q_proj": "colwise",
        f"{ATTENTION}.k_proj": f"colwise_heads({kv})",
        f"{ATTENTION}.v_proj": f"colwise_heads({kv})",
        f"{ATTENTION}.o_proj": "rowwise",
        f"{ATTENTION}.sinks": "split_heads",
        "layers.*.mlp.experts": EXPERT_STYLES[1],          # moe_experts_interleaved
    }
    return Policy(name="gpt_oss", plan=plan, attributes={ATTENTION: {"num_key_value_groups": kv_groups(kv)}},
                  divisible=("num_attention_heads",))
