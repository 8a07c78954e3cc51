"""BLOOM (`BloomModel`, `BloomForCausalLM`, `BloomFor*`). Paths are relative to `BloomModel`.

query_key_value is fused per head ([h0: q k v | h1: q k v | ...]), so a contiguous column split
hands each rank whole heads. The attention gets the block's residual positionally, so it is no
block input: the fused projection applies Megatron's f itself. ALiBi: the model builds one slope
per head of the whole model ([batch * heads, 1, keys]); each rank's attention takes its heads.
"""

from meshboost.shardformer.policies.base import Policy


def _check(config, tp_size: int) -> None:
    if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        raise ValueError(f"BLOOM with slow_but_exact=True and pretraining_tp={config.pretraining_tp} at "
                         f"tp_size={tp_size}: the model slices its output projections by the full hidden size, "
                         "which tensor parallelism splits; set config.slow_but_exact=False (the same numbers up to "
                         "round-off) or use tp_size=1")


BLOOM_POLICY = Policy(
    name="bloom",
    plan={
        "h.*.self_attention": "heads_bias",
        "h.*.self_attention.query_key_value": "colwise",
        "h.*.self_attention.dense": "rowwise",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    attributes={"h.*.self_attention": {"num_heads": "divide"}},
    divisible=("num_attention_heads",),
    pipeline_layout={"embeddings": ("word_embeddings", "word_embeddings_layernorm"), "layers": "h",
                     "tail": ("ln_f",)},
    check=_check,
)
