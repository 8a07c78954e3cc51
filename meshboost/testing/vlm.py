"""Tiny vision-language models for tests: configs, seeded random models and matching input batches.

Owns, per family in VLM_FAMILIES:
  * `vlm_config(family, **overrides)`: a tiny fp32-sized top-level config (text: hidden 64, 4 heads, 2 kv heads,
    2 layers, ffn 128, vocab VOCAB; vision: hidden 32, 2 heads, 2 layers, 16 px images, patch 4) with the
    image/begin/end-of-image ids inside the tiny vocab, the per-image token count matching the tiny tower,
    use_cache=False and every dropout 0.
  * `build_vlm(config, seed)`: the family's *ForConditionalGeneration model, seeded, in fp32.
  * `vlm_batches(config, steps, batch, seed)`: identical-on-every-rank training batches holding the real inputs
    the model's forward consumes (the token layout the family's processor would produce, pixel values of the
    family's shape, the family's extra masks / type ids, labels).
  * `split_batch(config, batch, parts, index)`: the index-th of `parts` equal data-parallel shares of a batch.

Every row holds exactly one image, so rows and images split together. Qwen-VL pixel_values are flattened over
images ([num_images * patches_per_image, C*T*P*P]) with image_grid_thw [num_images, 3]; `split_batch` slices
them by image (patch counts from image_grid_thw) while every other tensor splits along dim 0.

Family notes:
  * qwen2_5_vl / qwen3_vl: 16 px image, patch 4, merge 2 -> 4x4 patches -> 4 image tokens between
    <vision_start>/<vision_end>. mrope_section sums to head_dim // 2 = 8. mm_token_type_ids (1 on image tokens)
    is passed so the 3-D M-RoPE positions are built (Qwen3-VL refuses images without it). Qwen2.5-VL's vision
    window is one merged token (window_size 8) on block 0 and full attention on block 1; Qwen3-VL's deepstack
    taps vision block 0 and its position-embedding table is 4x4.
  * llava: CLIP tower, 16 patches (CLS dropped) -> 16 image tokens. vision_feature_layer is -1 (the checkpoints
    use -2) so the last vision block is trained too; CLIP's post_layernorm only feeds the pooled output, which
    LLaVA does not use, so it gets no gradient.
  * gemma3: SigLIP tower (no head), 16 patches average-pooled to mm_tokens_per_image = 4, wrapped in
    <start_of_image>/<end_of_image>; token_type_ids (1 on image tokens) give the bidirectional image mask. Text
    layers alternate sliding (window 8) / full attention. HF zero-initialises the image projection
    (mm_input_projection_weight); `build_vlm` draws it at random so the vision tower gets gradients.
  * idefics3 / smolvlm: 16 patches, pixel shuffle with scale_factor 2 -> 4 image tokens, laid out as
    <fake_token_around_image><global-img> image... <fake_token_around_image>; pixel_values
    [batch, 1, C, H, W] and pixel_attention_mask [batch, 1, H, W].
  * paligemma: SigLIP tower (no head), 16 image tokens first, then <bos> prompt and the suffix; token_type_ids
    are 0 on the prefix (image + prompt, attended bidirectionally) and 1 on the suffix, and only the suffix is
    labelled, as the PaliGemma processor does.
"""

from __future__ import annotations

import torch
import transformers as tfm

VOCAB = 199                      # prime: vocab padding is exercised at every tp size
PAD, BOS, EOS = 0, 1, 2
IMAGE, BOI, EOI, VIDEO = VOCAB - 1, VOCAB - 2, VOCAB - 3, VOCAB - 4
_TEXT_IDS = (3, VOCAB - 8)       # ordinary text tokens are drawn from this range
IMAGE_PX, PATCH, CHANNELS = 16, 4, 3
PROMPT_LEN, TEXT_LEN = 3, 9      # text tokens before / after the image block (plus <bos>)
IGNORE = -100


# ----------------------------------------------------------------------------------------------------------- sizes

def _text(**extra) -> dict:
    """Common tiny decoder settings."""
    return dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, intermediate_size=128, max_position_embeddings=128, attention_dropout=0.0,
                use_cache=False, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS) | extra


def _vit(**extra) -> dict:
    """Common tiny ViT settings (CLIP / SigLIP / Idefics3 vision configs)."""
    return dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_channels=CHANNELS, image_size=IMAGE_PX, patch_size=PATCH, attention_dropout=0.0) | extra


def _qwen_vision(**extra) -> dict:
    return dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=CHANNELS, patch_size=PATCH,
                temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64) | extra


# --------------------------------------------------------------------------------------------------------- configs

def _qwen2_5_vl(text: dict, vision: dict, top: dict):
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
    return tfm.Qwen2_5_VLConfig(
        text_config=tfm.Qwen2_5_VLTextConfig(**_text(rope_parameters=rope) | text),
        vision_config=tfm.Qwen2_5_VLVisionConfig(**_qwen_vision(window_size=8, fullatt_block_indexes=[1]) | vision),
        **_qwen_ids() | top)


def _qwen3_vl(text: dict, vision: dict, top: dict):
    rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True)
    return tfm.Qwen3VLConfig(
        text_config=tfm.Qwen3VLTextConfig(**_text(head_dim=16, rope_parameters=rope) | text),
        vision_config=tfm.Qwen3VLVisionConfig(**_qwen_vision(num_position_embeddings=16,
                                                             deepstack_visual_indexes=[0]) | vision),
        **_qwen_ids() | top)


def _qwen_ids() -> dict:
    return dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=BOI, vision_end_token_id=EOI)


def _llava(text: dict, vision: dict, top: dict):
    n = (IMAGE_PX // PATCH) ** 2
    return tfm.LlavaConfig(
        text_config=tfm.LlamaConfig(**_text() | text),
        vision_config=tfm.CLIPVisionConfig(**_vit(projection_dim=32, dropout=0.0) | vision),
        **dict(image_token_index=IMAGE, image_seq_length=n, vision_feature_layer=-1) | top)


def _gemma3(text: dict, vision: dict, top: dict):
    layers = text.get("num_hidden_layers", 2)
    text_kw = _text(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                    layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)])
    return tfm.Gemma3Config(
        text_config=tfm.Gemma3TextConfig(**text_kw | text),
        vision_config=tfm.SiglipVisionConfig(**_vit(vision_use_head=False) | vision),
        **dict(mm_tokens_per_image=4, boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE) | top)


def _idefics3_like(config_cls, vision_cls):
    def build(text: dict, vision: dict, top: dict):
        return config_cls(text_config=tfm.LlamaConfig(**_text() | text), vision_config=vision_cls(**_vit() | vision),
                          **dict(image_token_id=IMAGE, scale_factor=2, use_cache=False, pad_token_id=PAD) | top)
    return build


def _paligemma(text: dict, vision: dict, top: dict):
    return tfm.PaliGemmaConfig(
        text_config=tfm.GemmaConfig(**_text(head_dim=16) | text),
        vision_config=tfm.SiglipVisionConfig(**_vit(vision_use_head=False) | vision),
        **dict(image_token_index=IMAGE, vocab_size=VOCAB, projection_dim=64, hidden_size=64) | top)


_CONFIGS = {
    "qwen2_5_vl": _qwen2_5_vl,
    "qwen3_vl": _qwen3_vl,
    "llava": _llava,
    "gemma3": _gemma3,
    "idefics3": _idefics3_like(tfm.Idefics3Config, tfm.Idefics3VisionConfig),
    "smolvlm": _idefics3_like(tfm.SmolVLMConfig, tfm.SmolVLMVisionConfig),
    "paligemma": _paligemma,
}

_MODELS = {
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "llava": "LlavaForConditionalGeneration",
    "gemma3": "Gemma3ForConditionalGeneration",
    "idefics3": "Idefics3ForConditionalGeneration",
    "smolvlm": "SmolVLMForConditionalGeneration",
    "paligemma": "PaliGemmaForConditionalGeneration",
}

VLM_FAMILIES: tuple[str, ...] = tuple(_CONFIGS)


def vlm_config(family: str, **overrides):
    """The tiny top-level config of `family`. `text_config=` / `vision_config=` dicts update the sub-config
    settings before construction; other overrides are top-level constructor arguments."""
    if family not in _CONFIGS:
        raise ValueError(f"unknown tiny VLM family {family!r}; known: {VLM_FAMILIES}")
    text, vision = dict(overrides.pop("text_config", {})), dict(overrides.pop("vision_config", {}))
    config = _CONFIGS[family](text, vision, overrides)
    config.use_cache = False
    config.text_config.use_cache = False
    return config


def build_vlm(config, seed: int = 0) -> torch.nn.Module:
    """The family's *ForConditionalGeneration model with seeded random weights, in fp32."""
    torch.manual_seed(seed)
    model = getattr(tfm, _MODELS[config.model_type])(config)
    if config.model_type == "gemma3":
        _unzero_gemma3_projection(model, config)
    return model.float()


def _unzero_gemma3_projection(model, config) -> None:
    """HF initialises Gemma-3's image projection to zeros, which would cut the vision tower off the loss (its
    gradients would all be zero); a random one lets image features reach the loss, as in a trained checkpoint."""
    weight = model.model.multi_modal_projector.mm_input_projection_weight
    with torch.no_grad():
        weight.normal_(0.0, config.text_config.initializer_range)


# --------------------------------------------------------------------------------------------------------- batches

def image_tokens(config) -> int:
    """How many image-placeholder tokens one IMAGE_PX image becomes."""
    family = config.model_type
    if family in ("qwen2_5_vl", "qwen3_vl"):
        vc = config.vision_config
        return (IMAGE_PX // vc.patch_size) ** 2 // vc.spatial_merge_size ** 2
    if family == "llava":
        return config.image_seq_length
    if family == "gemma3":
        return config.mm_tokens_per_image
    if family in ("idefics3", "smolvlm"):
        return (IMAGE_PX // config.vision_config.patch_size) ** 2 // config.scale_factor ** 2
    if family == "paligemma":
        return config.text_config.num_image_tokens
    raise ValueError(f"unknown tiny VLM family {family!r}")


def _image_block(config) -> list[int]:
    """The image's token span as the family's processor lays it out."""
    body = [IMAGE] * image_tokens(config)
    family = config.model_type
    if family in ("qwen2_5_vl", "qwen3_vl", "gemma3"):
        return [BOI] + body + [EOI]
    if family in ("idefics3", "smolvlm"):
        return [BOI, EOI] + body + [BOI]        # <fake_token_around_image><global-img> ... <fake_token_around_image>
    return body


def _row_layout(config) -> tuple[list[int], int]:
    """Token template of one row (-1 = random text token) and the length of its unlabelled prefix."""
    block, prompt = _image_block(config), [-1] * PROMPT_LEN
    if config.model_type == "paligemma":
        prefix = block + [BOS] + prompt
        return prefix + [-1] * TEXT_LEN, len(prefix)
    return [BOS] + prompt + block + [-1] * TEXT_LEN, 1 + PROMPT_LEN


def _pixels(config, batch: int, gen: torch.Generator) -> dict:
    family = config.model_type
    if family in ("qwen2_5_vl", "qwen3_vl"):
        vc = config.vision_config
        side = IMAGE_PX // vc.patch_size
        width = CHANNELS * vc.temporal_patch_size * vc.patch_size ** 2
        return dict(pixel_values=torch.randn(batch * side * side, width, generator=gen),
                    image_grid_thw=torch.tensor([[1, side, side]] * batch))
    shape = (batch, CHANNELS, IMAGE_PX, IMAGE_PX)
    if family in ("idefics3", "smolvlm"):
        return dict(pixel_values=torch.randn(batch, 1, *shape[1:], generator=gen),
                    pixel_attention_mask=torch.ones(batch, 1, IMAGE_PX, IMAGE_PX, dtype=torch.bool))
    return dict(pixel_values=torch.randn(*shape, generator=gen))


def _type_ids(config, input_ids: torch.Tensor, prefix_len: int) -> dict:
    """The family's modality / prefix type ids (none for the families that take none)."""
    family = config.model_type
    is_image = (input_ids == IMAGE).int()
    if family in ("qwen2_5_vl", "qwen3_vl"):
        return dict(mm_token_type_ids=is_image)
    if family == "gemma3":
        return dict(token_type_ids=is_image.long())
    if family == "paligemma":
        suffix = torch.ones_like(input_ids)
        suffix[:, :prefix_len] = 0
        return dict(token_type_ids=suffix)
    return {}


def _one_batch(config, batch: int, gen: torch.Generator) -> dict:
    template, prefix_len = _row_layout(config)
    template = torch.tensor(template).expand(batch, -1)
    text = torch.randint(*_TEXT_IDS, template.shape, generator=gen)
    input_ids = torch.where(template < 0, text, template)
    labels = input_ids.clone()
    labels[:, :prefix_len] = IGNORE
    labels[input_ids >= EOI] = IGNORE                        # image placeholders and begin/end-of-image tokens
    labels[torch.rand(labels.shape, generator=gen) < 0.15] = IGNORE   # a few more, unevenly over rows
    out = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    return out | _type_ids(config, input_ids, prefix_len) | _pixels(config, batch, gen) | dict(labels=labels)


def vlm_batches(config, steps: int, batch: int = 4, seed: int = 5) -> list[dict]:
    """`steps` training batches of `batch` rows (one image each), identical on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return [_one_batch(config, batch, gen) for _ in range(steps)]


def split_batch(config, batch: dict, parts: int, index: int) -> dict:
    """The index-th of `parts` equal shares of `batch`: rows along dim 0 of every tensor; Qwen-VL's flattened
    pixel_values / image_grid_thw by the images of those rows (one image per row)."""
    rows = batch["input_ids"].shape[0]
    if rows % parts:
        raise ValueError(f"batch of {rows} rows does not split into {parts} equal parts")
    lo, hi = index * rows // parts, (index + 1) * rows // parts
    out = {k: v[lo:hi] for k, v in batch.items()}
    if "image_grid_thw" in batch:
        grid = batch["image_grid_thw"]
        per_row = grid.shape[0] // rows
        starts = torch.cat([grid.new_zeros(1), grid.prod(-1).cumsum(0)]).tolist()
        out["image_grid_thw"] = grid[lo * per_row:hi * per_row]
        out["pixel_values"] = batch["pixel_values"][starts[lo * per_row]:starts[hi * per_row]]
    return out
