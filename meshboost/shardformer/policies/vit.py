"""ViT (`ViTModel`, `ViTForImageClassification`, `ViTForMaskedImageModeling`). Paths are relative
to `ViTModel`. The patch embedding (a convolution) and the heads stay replicated."""

from meshboost.shardformer.policies.base import Policy

VIT_POLICY = Policy(
    name="vit",
    plan={
        "layers.*.attention": "block_input",              # the residual is added outside the attention
        **{f"layers.*.attention.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        "layers.*.attention.o_proj": "rowwise",
        "layers.*.mlp.fc1": "colwise",
        "layers.*.mlp.fc2": "rowwise",
    },
    attributes={"layers.*.attention": {"num_attention_heads": "divide"}},
    divisible=("num_attention_heads", "intermediate_size"),
    vocab_parallel=False,
    pipeline_layout={"embeddings": ("embeddings",), "layers": "layers", "tail": ("layernorm", "pooler")},
)
