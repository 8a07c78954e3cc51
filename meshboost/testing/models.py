"""Tiny model zoo: configs for fast tests (no downloads) and their inputs (`tiny_batch` per head, `token_batches`
of random tokens). Sizes divide by tp 1, 2 and 4; vocab sizes deliberately do not, so vocab padding is always
exercised."""

from __future__ import annotations

import copy

import torch
import transformers as tfm

VOCAB = 101   # prime: padded at every tp


# Families built on the common sizes (hidden 32, 4 heads, ffn 64): config class -> its other settings.
_ON_COMMON = {
    "bert": ("BertConfig", dict(max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                type_vocab_size=2)),
    "llama": ("LlamaConfig", dict(num_key_value_heads=4, max_position_embeddings=64)),
    "llama_gqa": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)),
    # 8 query heads, 2 kv heads: at tp=4 each kv head lives on 2 ranks
    "llama_kv2": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)),
    # multi-query: one kv head, held by every rank
    "llama_mqa": ("LlamaConfig", dict(num_key_value_heads=1, max_position_embeddings=64)),
    # per-head q/k norm weights [heads, head_dim]; 2 kv heads (replicas at tp=4)
    "cohere_qk": ("CohereConfig", dict(num_attention_heads=8, num_key_value_heads=2, use_qk_norm=True,
                                       max_position_embeddings=64)),
    # whole-hidden q/k LayerNorms: q/k/v gathered, attention on every rank
    "esmc": ("EsmcConfig", dict(num_key_value_heads=4, max_position_embeddings=64, pad_token_id=1,
                                classifier_dropout=0.0)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=4, max_position_embeddings=64)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=4, max_position_embeddings=64, sliding_window=None)),
    # a scaled word embedding (x sqrt(hidden)) that must survive sharding
    "gemma": ("GemmaConfig", dict(num_key_value_heads=4, head_dim=8, max_position_embeddings=64)),
    # scaled embedding, soft-capping, alternating sliding/full layers
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=4,
                                    query_pre_attn_scalar=8)),
    # factorised embedding (16 -> 32), one shared layer group
    "albert": ("AlbertConfig", dict(embedding_size=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                    classifier_dropout_prob=0.0, max_position_embeddings=64)),
}


def tiny_config(family: str, **overrides):
    """A tiny transformers config for `family` (a key of MODEL_CLASSES, or 'qwen2_sliding', 'gemma2')."""
    layers = overrides.pop("num_hidden_layers", 2)       # at construction: per-layer lists follow it
    if family in _ON_COMMON:
        class_name, settings = _ON_COMMON[family]
        cfg = getattr(tfm, class_name)(**(_common(layers) | settings))
    elif family in _BUILDERS:
        cfg = _BUILDERS[family](family, layers, overrides)
    else:
        raise ValueError(f"unknown tiny family {family!r}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.pad_token_id = 0
    return cfg


def _common(layers: int) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=layers,
                intermediate_size=64)


def _qwen2_sliding(family: str, layers: int, overrides: dict):
    """Per-layer types: layers >= max_window_layers use a 4-token window."""
    return tfm.Qwen2Config(**_common(layers), num_key_value_heads=4, max_position_embeddings=64,
                           use_sliding_window=True, sliding_window=4,
                           max_window_layers=overrides.pop("max_window_layers", 2))


def _gpt2(family: str, layers: int, overrides: dict):
    return tfm.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=layers, n_inner=64, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1,
                          eos_token_id=VOCAB - 1)


def _opt(family: str, layers: int, overrides: dict):
    """word_embed_proj_dim != hidden: project_in / project_out."""
    return tfm.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=16,
                         num_hidden_layers=layers, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0)


def _bloom(family: str, layers: int, overrides: dict):
    """ALiBi, fused per-head query_key_value."""
    return tfm.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_head=4, n_layer=layers, hidden_dropout=0.0,
                           attention_dropout=0.0)


_FALCON_ATTENTION = {
    "falcon": dict(new_decoder_architecture=True, num_attention_heads=8, num_kv_heads=2),   # grouped
    "falcon_mqa": dict(multi_query=True, parallel_attn=True),                               # falcon-7b
    "falcon_alibi": dict(multi_query=False, alibi=True, parallel_attn=False),
}


def _falcon(family: str, layers: int, overrides: dict):
    return tfm.FalconConfig(vocab_size=VOCAB, hidden_size=64 if family == "falcon" else 32, num_hidden_layers=layers,
                            ffn_hidden_size=64, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0,
                            **{"new_decoder_architecture": False, "num_attention_heads": 4,
                               **_FALCON_ATTENTION[family]})


def _vit(family: str, layers: int, overrides: dict):
    return tfm.ViTConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=layers, intermediate_size=64,
                         image_size=16, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                         num_labels=3)


def _t5(family: str, layers: int, overrides: dict):
    """t5_gated: T5 v1.1 / Flan (gated-gelu, untied head)."""
    extra = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False) if family == "t5_gated" else {}
    return tfm.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=layers,
                        num_decoder_layers=layers, dropout_rate=0.0, decoder_start_token_id=0, eos_token_id=1,
                        relative_attention_num_buckets=8, **extra)


def _whisper(family: str, layers: int, overrides: dict):
    """Audio encoder (conv front end) + decoder with cross-attention."""
    return tfm.WhisperConfig(vocab_size=VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                             decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=8, max_target_positions=32,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                             suppress_tokens=None, begin_suppress_tokens=None, dropout=0.0, attention_dropout=0.0,
                             activation_dropout=0.0)


def _blip2(family: str, layers: int, overrides: dict):
    """Vision tower + Q-Former (2 query tokens) + OPT; image token = VOCAB - 1."""
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=8, attention_dropout=0.0)
    qformer = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, encoder_hidden_size=32, max_position_embeddings=64,
                   hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    text = tfm.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=layers,
                         ffn_dim=64, word_embed_proj_dim=32, max_position_embeddings=64, dropout=0.0,
                         attention_dropout=0.0)
    return tfm.Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text.to_dict(),
                           num_query_tokens=2, image_token_index=VOCAB - 1)


_BUILDERS = {"qwen2_sliding": _qwen2_sliding, "gpt2": _gpt2, "opt": _opt, "bloom": _bloom, "falcon": _falcon,
             "falcon_mqa": _falcon, "falcon_alibi": _falcon, "vit": _vit, "t5": _t5, "t5_gated": _t5,
             "whisper": _whisper, "blip2": _blip2}


MODEL_CLASSES = {
    "bert": ("BertModel", "BertForSequenceClassification", "BertForMaskedLM", "BertLMHeadModel",
             "BertForTokenClassification", "BertForQuestionAnswering"),
    "gpt2": ("GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification"),
    "llama": ("LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification"),
    "llama_gqa": ("LlamaForCausalLM",),
    "llama_kv2": ("LlamaForCausalLM",),
    "llama_mqa": ("LlamaForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "cohere_qk": ("CohereForCausalLM",),
    "esmc": ("EsmcForMaskedLM", "EsmcForSequenceClassification"),
    "mistral": ("MistralForCausalLM",),
    "gemma": ("GemmaForCausalLM",),
    "opt": ("OPTForCausalLM", "OPTForSequenceClassification"),
    "bloom": ("BloomForCausalLM",),
    "falcon": ("FalconForCausalLM",),
    "falcon_mqa": ("FalconForCausalLM",),
    "falcon_alibi": ("FalconForCausalLM",),
    "vit": ("ViTForImageClassification",),
    "albert": ("AlbertForMaskedLM", "AlbertForSequenceClassification"),
    "t5": ("T5ForConditionalGeneration", "T5EncoderModel"),
    "t5_gated": ("T5ForConditionalGeneration",),
    "whisper": ("WhisperForConditionalGeneration",),
    "blip2": ("Blip2ForConditionalGeneration",),
}


def build_model(class_name: str, config, seed: int = 0) -> torch.nn.Module:
    """Instantiate `transformers.<class_name>(config)` with seeded random weights (eager-free, fp32)."""
    torch.manual_seed(seed)
    config.is_decoder = class_name == "BertLMHeadModel"
    model = getattr(tfm, class_name)(config)
    if isinstance(getattr(model, "query_tokens", None), torch.nn.Parameter):
        # BLIP-2 initialises its query tokens to zeros, which its first LayerNorm turns into gradients of
        # ~1e14 (1/sqrt(eps)): trained checkpoints never hold zeros, so neither do the tiny models.
        with torch.no_grad():
            model.query_tokens.normal_(0.0, 1.0)
    return model.float()


def sharper_copy(model: torch.nn.Module, factor: float = 4.0) -> torch.nn.Module:
    """A copy of a causal LM whose output head is `factor` x sharper: a reference whose log-probs differ from the
    policy's row by row (KTO's KL estimate is then positive and differs between replicas; equal weights give 0,
    which the estimate's clamp at 0 hides)."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        ref.get_output_embeddings().weight.mul_(factor)
    return ref


def vocab_edge_ids(vocab_size: int, tp_size: int, multiple: int = 64) -> list[int]:
    """Every id on an edge of a vocabulary split over `tp_size` ranks, padded to a multiple of `multiple`
    times `tp_size` as the vocab-parallel layers pad it (`make_vocab_size_divisible_by`): 0, each shard's
    first and last real id, the last real id. A rule off by one at a shard edge (`>` for `>=`) gives
    exactly these ids a wrong embedding, logit, loss or gradient, and random ids seldom hit them."""
    step = multiple * tp_size if multiple > 1 else tp_size
    part = -(-vocab_size // step) * step // tp_size
    edges = {0, vocab_size - 1}
    for start in range(0, vocab_size, part):
        edges |= {start, min(start + part, vocab_size) - 1}
    return sorted(edges)


def vocab_edge_batch(class_name: str, config, tp_size: int, batch: int = 4, seq: int = 8) -> dict:
    """`tiny_batch` of a text model whose input ids (and language-model labels, ignored ones kept) are
    `vocab_edge_ids` over and over, each edge at several positions: an explicit batch for the shard
    edges, which the fixed batches (ids drawn from 1..vocab-1) never guarantee (id 0 never appears)."""
    out = tiny_batch(class_name, config, batch, seq)
    edges = torch.tensor(vocab_edge_ids(config.vocab_size, tp_size))
    row = edges.repeat(-(-seq // len(edges)))[:seq]
    ids = torch.stack([row.roll(r) for r in range(batch)])      # each edge at several positions
    out["input_ids"] = ids
    if "labels" in out and out["labels"].shape == ids.shape:
        out["labels"] = ids.masked_fill(out["labels"] == -100, -100)
    return out


def token_batches(config, steps: int, batch: int = 4, seq: int = 8, seed: int = 5, *, num_labels: int | None = None,
                  attention_mask: bool = False, ignored: bool = False) -> list[dict]:
    """`steps` batches of random token ids in 1..vocab-1, drawn in order from one generator seeded with `seed`
    (the same on every rank). Labels are the ids (a causal LM's; `ignored`: row 1's first 3 are -100), or with
    `num_labels` one class per row (a sequence classifier's, drawn after its batch's ids); `attention_mask`
    adds an all-ones mask. Without `ignored` every row holds as many labelled tokens: the mean of the replicas'
    mean losses is then the whole batch's."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)
        if num_labels is not None:
            labels = torch.randint(0, num_labels, (batch,), generator=g)
        else:
            labels = ids.clone()
            if ignored:
                labels[1, :3] = -100
        out.append({"input_ids": ids} | ({"attention_mask": torch.ones_like(ids)} if attention_mask else {})
                   | {"labels": labels})
    return out


def tiny_batch(class_name: str, config, batch: int = 4, seq: int = 8, seed: int = 1) -> dict:
    """Inputs (with labels matching the head) for one step; identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    if class_name.startswith("ViT"):
        out = {"pixel_values": torch.randn(batch, config.num_channels, config.image_size, config.image_size,
                                           generator=g)}
        if class_name.endswith("ImageClassification"):
            out["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
        return out
    if class_name.startswith("Blip2"):                          # image tokens first, then text to predict
        vision = config.vision_config
        ids = torch.randint(3, config.text_config.vocab_size - 1, (batch, seq), generator=g)
        ids[:, :config.num_query_tokens] = config.image_token_index
        labels = ids.clone()
        labels[:, :config.num_query_tokens] = -100
        labels[1, -2:] = -100
        return {"pixel_values": torch.randn(batch, 3, vision.image_size, vision.image_size,
                                            generator=g), "input_ids": ids, "labels": labels}
    if class_name.endswith("ConditionalGeneration"):           # encoder-decoder: labels make the decoder input
        labels = torch.randint(3, config.vocab_size, (batch, seq - 2), generator=g)
        labels[1, -2:] = -100
        if class_name.startswith("Whisper"):
            frames = 2 * config.max_source_positions
            return {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=g), "labels": labels}
        ids = torch.randint(3, config.vocab_size, (batch, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)
    out = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    out["attention_mask"][0, -2:] = 0
    if class_name.endswith("SequenceClassification"):
        out["labels"] = torch.randint(0, config.num_labels, (batch,), generator=g)
    elif class_name.endswith("TokenClassification"):
        out["labels"] = torch.randint(0, config.num_labels, (batch, seq), generator=g)
    elif class_name.endswith("QuestionAnswering"):
        out["start_positions"] = torch.randint(0, seq, (batch,), generator=g)
        out["end_positions"] = torch.randint(0, seq, (batch,), generator=g)
    elif class_name.endswith(("LM", "LMHeadModel", "CausalLM")):
        labels = ids.clone()
        labels[1, :3] = -100
        out["labels"] = labels
    return out
