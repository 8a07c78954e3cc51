"""OPT (`OPTModel`, `OPTForCausalLM`, `OPTFor*`). Paths are relative to `OPTModel`."""

from meshboost.shardformer.policies.base import Policy

_LAYER = "decoder.layers.*"

OPT_POLICY = Policy(
    name="opt",
    plan={
        f"{_LAYER}.self_attn": "block_input",         # q, k, v read one input: its grad all-reduced once
        **{f"{_LAYER}.self_attn.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        f"{_LAYER}.self_attn.out_proj": "rowwise",
        f"{_LAYER}.fc1": "colwise",
        f"{_LAYER}.fc2": "rowwise",
    },
    # the forward views q/k/v as (batch, -1, num_heads, head_dim): num_heads must be the local count
    attributes={f"{_LAYER}.self_attn": {"num_heads": "divide"}},
    divisible=("num_attention_heads", "ffn_dim"),
    pipeline_layout={"embeddings": ("decoder.embed_tokens", "decoder.embed_positions", "decoder.project_in"),
                     "layers": "decoder.layers",
                     "tail": ("decoder.final_layer_norm", "decoder.project_out")},
)
