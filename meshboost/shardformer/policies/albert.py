"""ALBERT (`AlbertModel` and every `AlbertFor*` head). Paths are relative to `AlbertModel`.

The attention module adds its own input as the residual before its LayerNorm, so it is no block
input (Megatron's f there would sum the residual's gradient over tp): each of query, key and value
applies f itself. The layer groups are shared by every layer that uses them; sharding them once
shards every use.
"""

from meshboost.shardformer.policies.base import Policy

_LAYER = "encoder.albert_layer_groups.*.albert_layers.*"

ALBERT_POLICY = Policy(
    name="albert",
    plan={
        **{f"{_LAYER}.attention.{p}": "colwise" for p in ("query", "key", "value")},
        f"{_LAYER}.attention.dense": "rowwise",
        f"{_LAYER}.ffn": "colwise",
        f"{_LAYER}.ffn_output": "rowwise",
    },
    attributes={f"{_LAYER}.attention": {"num_attention_heads": "divide", "all_head_size": "divide"}},
    divisible=("num_attention_heads", "intermediate_size"),
)
