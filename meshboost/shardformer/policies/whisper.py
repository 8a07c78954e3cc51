"""Whisper (`WhisperModel`, `WhisperForConditionalGeneration`, `WhisperForAudioClassification`).
Paths are relative to `WhisperModel`. The convolutional audio front end and the encoder's
positional embedding stay replicated; the decoder's token embedding and the tied `proj_out` are
vocab-parallel. Cross-attention's key and value read the encoder output (`key_value_states`)."""

from meshboost.shardformer.policies.base import Policy


def _attention(prefix: str) -> dict[str, str]:
    return {
        prefix: "block_input",
        **{f"{prefix}.{p}": "colwise" for p in ("q_proj", "k_proj", "v_proj")},
        f"{prefix}.out_proj": "rowwise",
    }


def _stack(stack: str, attentions: tuple[str, ...]) -> dict[str, str]:
    plan = {f"{stack}.layers.*.fc1": "colwise", f"{stack}.layers.*.fc2": "rowwise"}
    for name in attentions:
        plan.update(_attention(f"{stack}.layers.*.{name}"))
    return plan


WHISPER_POLICY = Policy(
    name="whisper",
    plan={**_stack("encoder", ("self_attn",)), **_stack("decoder", ("self_attn", "encoder_attn"))},
    attributes={f"{stack}.layers.*.{name}": {"num_heads": "divide"}
                for stack, name in (("encoder", "self_attn"), ("decoder", "self_attn"), ("decoder", "encoder_attn"))},
    divisible=("encoder_attention_heads", "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim"),
    block_input_kwargs=("hidden_states", "key_value_states"),
    # Two segments: the audio encoder (convolutions and position table first), then the decoder,
    # which reads the encoder output on every stage. `WhisperForAudioClassification` (no decoder)
    # ends with the encoder, so its head is the encoder's tail.
    pipeline_layout={"segments": [
        {"stack": "encoder", "embeddings": ("encoder.conv1", "encoder.conv2", "encoder.embed_positions"),
         "layers": "encoder.layers", "tail": ("encoder.layer_norm", "projector", "classifier", "layer_weights")},
        {"stack": "decoder", "embeddings": ("decoder.embed_tokens", "decoder.embed_positions"),
         "layers": "decoder.layers", "tail": ("decoder.layer_norm",)},
    ]},
)
