"""ESM-C (`EsmcModel`, `EsmcFor*`). Paths are relative to `EsmcModel`.

Its q/k norms are LayerNorms over the whole hidden width (`q_norm(q_proj(x))`), so a rank holding
part of q cannot normalise it. As transformers' plan for OLMo2 does for the same shape, q, k and v
are column-parallel with their outputs gathered (attention runs on every head on every rank) and
the output projection splits its replicated input; the MLP is split as usual.
"""

from meshboost.shardformer.policies.base import Policy

ESMC_POLICY = Policy(
    name="esmc",
    plan={
        **{f"layers.*.self_attn.{p}": "colwise_gather" for p in ("q_proj", "k_proj", "v_proj")},
        "layers.*.self_attn.o_proj": "rowwise_split",
        "layers.*.mlp": "block_input",                     # gate and up read one input: its grad all-reduced once
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
    divisible=("num_attention_heads", "intermediate_size"),
)
