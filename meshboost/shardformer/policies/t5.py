"""T5 (`T5Model`, `T5ForConditionalGeneration`, `T5EncoderModel`, `T5For*`). Paths are relative to
the model (T5 is its own base model).

The shared embedding is reached by three paths (`shared`, `encoder.embed_tokens`,
`decoder.embed_tokens`): the sharder replaces it at all of them. The relative position bias is an
embedding with one output per head: each rank keeps its heads' columns, and the bias it computes
in the first block flows, split like the heads, through every later block. Cross-attention's key
and value read the encoder output (`key_value_states`).
"""

from meshboost.shardformer.policies.base import Policy


def _attention(prefix: str) -> dict[str, str]:
    return {
        prefix: "block_input",
        **{f"{prefix}.{p}": "colwise" for p in ("q", "k", "v")},
        f"{prefix}.o": "rowwise",
    }


def _stack(stack: str) -> dict[str, str]:
    block = f"{stack}.block.*.layer"
    return {
        **_attention(f"{block}.0.SelfAttention"),
        f"{block}.0.SelfAttention.relative_attention_bias": "embedding_heads",
        **_attention(f"{block}.1.EncDecAttention"),
        f"{block}.*.DenseReluDense": "block_input",          # wi, or gated wi_0 and wi_1
        **{f"{block}.*.DenseReluDense.{p}": "colwise" for p in ("wi", "wi_0", "wi_1")},
        f"{block}.*.DenseReluDense.wo": "rowwise",
    }


_HEADS = {"n_heads": "divide", "inner_dim": "divide"}

T5_POLICY = Policy(
    name="t5",
    plan={**_stack("encoder"), **_stack("decoder")},
    attributes={f"{stack}.block.*.layer.{i}.{name}": _HEADS for stack in ("encoder", "decoder")
                for i, name in ((0, "SelfAttention"), (1, "EncDecAttention"))},
    divisible=("num_heads", "d_ff"),
    block_input_kwargs=("hidden_states", "key_value_states"),
    # Two segments: the encoder, then the decoder (which reads the encoder output on every stage).
    # The first block of each stack computes the relative position bias and the stack hands it to
    # every later block: a boundary inside a stack carries it (output 1 -> argument 2), with its
    # gradient back to the first block's bias table. The decoder's cross-attention bias is zeros,
    # which a later stage's first block computes itself.
    pipeline_layout={"segments": [
        {"stack": "encoder", "embeddings": ("shared", "encoder.embed_tokens"), "layers": "encoder.block",
         "tail": ("encoder.final_layer_norm",), "carry": ((1, 2, "position_bias"),)},
        {"stack": "decoder", "embeddings": ("decoder.embed_tokens",), "layers": "decoder.block",
         "tail": ("decoder.final_layer_norm", "lm_head"), "carry": ((1, 2, "position_bias"),)},
    ]},
)
