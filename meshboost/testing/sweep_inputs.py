"""The model sweep's inputs (sweep.py): the batch both the sharded and the unsharded tiny model see.

Owns: token ids (2 x 8, labels for a causal LM) and, per model type that takes more or other inputs,
what it needs: Qwen-VL style flattened patches with their grid, Gemma 4's positioned patches, Llama 4's
image with its image tokens, embeddings for heads their parent model feeds, a decoder's encoder states.
Must not build or shard models.
"""

from __future__ import annotations

import torch

# fed embeddings by their parent model, never token ids
EMBEDS_ONLY = ("qwen3_omni_moe_talker_code_predictor", "qwen3_omni_moe_talker_text")


def _patches(key: str):
    """Flattened patches of two 4 x 4 images with their (t, h, w) grid (Qwen-VL style vision towers)."""
    def inputs(config, g) -> dict:
        temporal = getattr(config, "temporal_patch_size", None) or getattr(config, "patch_temporal", None) or 1
        channels = getattr(config, "in_channels", None) or getattr(config, "num_channels", None) or 3
        width = channels * temporal * config.patch_size ** 2
        return {key: torch.randn(32, width, generator=g), "grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]])}
    return inputs


def _positioned_patches(config, g) -> dict:
    """Gemma 4's vision tower: two images of 6 x 6 patches, each with its (x, y) position."""
    n = 6
    grid = torch.stack(torch.meshgrid(torch.arange(n), torch.arange(n), indexing="ij"), -1).reshape(1, n * n, 2)
    return {"pixel_values": torch.randn(2, n * n, 3 * config.patch_size ** 2, generator=g),
            "pixel_position_ids": grid.repeat(2, 1, 1)}


def _image_and_text(config, g) -> dict:
    """Llama 4's multimodal model: one 56 x 56 image per row, its features (4 after the pixel shuffle)
    at the image tokens, then text; labels on the text."""
    vision = config.vision_config
    features = int((vision.image_size // vision.patch_size) ** 2 * vision.pixel_shuffle_ratio ** 2)
    ids = torch.randint(3, 150, (2, 4 + features), generator=g)
    ids[:, 1:1 + features] = config.image_token_index
    labels = ids.clone()
    labels[:, :1 + features] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
            "pixel_values": torch.randn(2, 3, vision.image_size, vision.image_size, generator=g)}


# Inputs of the types that take more than token ids (vision towers, drafting heads, a multimodal model):
# (config, generator) -> batch
TYPE_INPUTS = {
    "llama4": _image_and_text,
    "dots3_note_vision_encoder": _patches("pixel_values"),
    "ernie4_5_vl_moe_vision": _patches("hidden_states"),
    "muse_glimmer_vision": _patches("pixel_values"),
    "gemma4_vision": _positioned_patches,
    "llama4_vision_model": lambda c, g: {"pixel_values": torch.randn(2, 3, c.image_size, c.image_size, generator=g)},
    # image patch embeddings (the first 4 positions attend both ways) then query tokens
    "deepseek_ocr2_encoder": lambda c, g: {"inputs_embeds": torch.randn(2, 8, c.hidden_size, generator=g),
                                           "num_patches": 4},
    # a block of noised embeddings denoised against the target model's hidden states (two of its layers)
    "muse_glimmer_assistant": lambda c, g: {
        "noise_embeds": torch.randn(2, c.block_size, c.hidden_size, generator=g),
        "context_hidden_states": torch.randn(2, 4, c.hidden_size * len(c.target_layer_ids), generator=g)},
}


def batch_for(model) -> dict:
    """The batch both models see: token ids (2 x 8) with labels for a causal LM, plus what the type
    needs besides (the inputs of vision and audio models, conditioning its parent model computes)."""
    g = torch.Generator().manual_seed(1)
    model_type = model.config.model_type
    hidden = getattr(model.config, "hidden_size", 64)          # the sweep's tiny width
    if model_type in TYPE_INPUTS:
        return TYPE_INPUTS[model_type](model.config, g)
    if model_type in EMBEDS_ONLY:               # fed embeddings by its parent model, never token ids
        embeds = torch.randn(2, 8, hidden, generator=g)
        return {"inputs_embeds": embeds, "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(3, min(vocab, 150), (2, 8), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if type(model).__name__.endswith("ForCausalLM"):
        labels = ids.clone()
        labels[1, :3] = -100
        batch["labels"] = labels
    if model_type == "voxtral_realtime_text":  # the delay-time conditioning the audio model computes
        batch["t_cond"] = torch.randn(1, 1, hidden, generator=g)
    if model_type == "t5gemma2_decoder":        # a decoder alone: what its encoder would give
        batch["encoder_hidden_states"] = torch.randn(2, 8, hidden, generator=g)
    return batch
