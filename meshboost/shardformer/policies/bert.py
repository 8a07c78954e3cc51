"""BERT (`BertModel` and every `BertFor*` head). Paths are relative to `BertModel`."""

from meshboost.shardformer.policies.base import Policy


def _attention(prefix: str) -> dict[str, str]:
    return {
        f"{prefix}.self": "block_input",            # q, k, v read one input: all-reduce its grad once
        f"{prefix}.self.query": "colwise",
        f"{prefix}.self.key": "colwise",
        f"{prefix}.self.value": "colwise",
        f"{prefix}.output.dense": "rowwise",        # summed before the residual LayerNorm
    }


BERT_POLICY = Policy(
    name="bert",
    plan={
        **_attention("encoder.layer.*.attention"),
        **_attention("encoder.layer.*.crossattention"),
        "encoder.layer.*.intermediate.dense": "colwise",
        "encoder.layer.*.output.dense": "rowwise",
    },
    attributes={
        "encoder.layer.*.attention.self": {"num_attention_heads": "divide", "all_head_size": "divide"},
        "encoder.layer.*.crossattention.self": {"num_attention_heads": "divide", "all_head_size": "divide"},
    },
    divisible=("num_attention_heads", "intermediate_size"),
    # cross-attention's key/value read the encoder's hidden states
    block_input_kwargs=("hidden_states", "encoder_hidden_states"),
    pipeline_layout={"embeddings": ("embeddings",), "layers": "encoder.layer", "tail": ("pooler",)},
)
