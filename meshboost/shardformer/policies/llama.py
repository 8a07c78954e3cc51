"""Llama (`LlamaModel`, `LlamaForCausalLM`, `LlamaFor*`), grouped-query attention included.

Llama ships `base_model_tp_plan`; this table adds only what that plan cannot say: where the
Megatron f goes (once per attention and MLP block) and which config fields must divide.
With both q heads and kv heads split, `num_key_value_groups` stays H/KV, so no attribute fix-up.
"""

from meshboost.shardformer.policies.base import Policy

LLAMA_POLICY = Policy(
    name="llama",
    plan={
        "layers.*.self_attn": "block_input",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp": "block_input",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    divisible=("num_attention_heads", "num_key_value_heads", "intermediate_size"),
)
