"""ALBERT (`AlbertModel` and every `AlbertFor*` head). Paths are relative to `AlbertModel`.

The attention module adds its own input as the residual before its LayerNorm, so it is no block
input (Megatron's f there would sum the residual's gradient over tp): each of query, key and value
applies f itself. The layer groups are shared by every layer that uses them; sharding them once
shards every use. Pipeline stages split the iterations over the groups (see `pipeline_layout`).
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
    # The encoder runs num_hidden_layers iterations over num_hidden_groups shared groups: stages split
    # the iterations, and a group's weights live on every stage running one of its iterations.
    pipeline_layout={"embeddings": ("embeddings", "encoder.embedding_hidden_mapping_in"),
                     "layers": "encoder.albert_layer_groups", "tail": ("pooler",),
                     "counted_by": "encoder", "shared_groups": "num_hidden_groups"},
)
