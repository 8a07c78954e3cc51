"""BLIP-2 (`Blip2ForConditionalGeneration`: vision tower + Q-Former + OPT language model). Paths are
relative to the model itself (it is its own base model).

Each part is sharded by its own table: the Q-Former like BERT (self- and cross-attention, the
query and text feed-forwards), the language model by the OPT table under `language_model.model.`,
its embedding and LM head vocab-parallel. The vision tower's MLP is split; its attention stays
replicated: `Blip2Attention` reshapes its fused qkv output with the input's full width
(`embed_dim // num_heads`), which no per-rank attribute can make right, so splitting it would need
a forward of our own. Only an OPT language model is supported (the T5 variants are refused, under tp and pp).
"""

from meshboost.shardformer.policies.base import Policy
from meshboost.shardformer.policies.opt import OPT_POLICY

_Q = "qformer.encoder.layer.*"
_LM = "language_model.model."


def _qformer_attention(prefix: str) -> dict[str, str]:
    return {
        f"{prefix}.attention": "block_input",
        **{f"{prefix}.attention.{p}": "colwise" for p in ("query", "key", "value")},
        f"{prefix}.output.dense": "rowwise",
    }


def _check(config, tp_size: int) -> None:
    text = getattr(getattr(config, "text_config", None), "model_type", None)
    if text != "opt":
        raise ValueError(f"BLIP-2 with a {text!r} language model at tp_size={tp_size}: meshboost's BLIP-2 table "
                         "shards the OPT variants only; use tp_size=1 for this checkpoint")
    for part, field in (("qformer_config", "num_attention_heads"), ("qformer_config", "intermediate_size"),
                        ("text_config", "num_attention_heads"), ("text_config", "ffn_dim"),
                        ("vision_config", "intermediate_size")):
        value = getattr(getattr(config, part), field)
        if value % tp_size:
            raise ValueError(f"BLIP-2 {part}.{field}={value} is not divisible by tp_size={tp_size}; choose a "
                             "tp_size that divides it")


BLIP2_POLICY = Policy(
    name="blip-2",
    plan={
        "vision_model.encoder.layers.*.mlp.fc1": "colwise",
        "vision_model.encoder.layers.*.mlp.fc2": "rowwise",
        **_qformer_attention(f"{_Q}.attention"),
        **_qformer_attention(f"{_Q}.crossattention"),
        **{f"{_Q}.{ff}.dense": "colwise" for ff in ("intermediate_query", "intermediate")},
        **{f"{_Q}.{ff}.dense": "rowwise" for ff in ("output_query", "output")},
        **{_LM + path: style for path, style in OPT_POLICY.plan.items()},
    },
    attributes={
        f"{_Q}.attention.attention": {"num_attention_heads": "divide", "all_head_size": "divide"},
        f"{_Q}.crossattention.attention": {"num_attention_heads": "divide", "all_head_size": "divide"},
        **{_LM + path: rules for path, rules in OPT_POLICY.attributes.items()},
    },
    # the Q-Former's cross-attention key/value read the vision tower's output
    block_input_kwargs=("hidden_states", "encoder_hidden_states"),
    check=_check,
    # Three segments run in order: the vision tower, the Q-Former (its query tokens and input norm
    # first; its cross-attention reads the vision output, carried to every Q-Former stage), the OPT
    # language model (the projection of the Q-Former output and the token embedding first: BLIP-2's
    # forward embeds the prompt and scatters the image features into it before calling the LM).
    pipeline_layout={"segments": [
        {"stack": "vision_model", "embeddings": ("vision_model.embeddings",), "layers": "vision_model.encoder.layers",
         "tail": ("vision_model.post_layernorm",)},
        {"stack": "qformer", "embeddings": ("query_tokens", "qformer.layernorm"), "layers": "qformer.encoder.layer",
         "counted_by": "qformer.encoder"},          # loops over range(config.num_hidden_layers)
        {"stack": "language_model",
         "embeddings": ("language_projection", *(f"{_LM}decoder.{p}" for p in ("embed_tokens", "embed_positions",
                                                                                "project_in"))),
         "layers": f"{_LM}decoder.layers",
         "tail": (f"{_LM}decoder.final_layer_norm", f"{_LM}decoder.project_out", "language_model.lm_head")},
    ]},
)
