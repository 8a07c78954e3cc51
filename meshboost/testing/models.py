"""Tiny model zoo: configs for fast tests (no downloads). Sizes divide by tp 1, 2 and 4; vocab
sizes deliberately do not, so vocab padding is always exercised."""

from __future__ import annotations

import torch
import transformers as tfm

VOCAB = 101   # prime: padded at every tp


def tiny_config(family: str, **overrides):
    """A tiny transformers config for `family` ('bert', 'gpt2', 'llama', 'llama_gqa', 'qwen2', 'mistral',
    'qwen2_sliding', 'gemma', 'gemma2', 'llama_kv2', 'llama_mqa')."""
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4,
                  num_hidden_layers=overrides.pop("num_hidden_layers", 2),  # at construction: per-layer lists follow it
                  intermediate_size=64)
    if family == "bert":
        cfg = tfm.BertConfig(**common, max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, type_vocab_size=2)
    elif family == "gpt2":
        cfg = tfm.GPT2Config(vocab_size=VOCAB, n_embd=32, n_head=4, n_layer=common["num_hidden_layers"], n_inner=64,
                             n_positions=64,
                             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1,
                             eos_token_id=VOCAB - 1)
    elif family == "llama":
        cfg = tfm.LlamaConfig(**common, num_key_value_heads=4, max_position_embeddings=64)
    elif family == "llama_gqa":
        cfg = tfm.LlamaConfig(**common | {"num_attention_heads": 8}, num_key_value_heads=4, max_position_embeddings=64)
    elif family == "llama_kv2":           # 8 query heads, 2 kv heads: at tp=4 each kv head lives on 2 ranks
        cfg = tfm.LlamaConfig(**common | {"num_attention_heads": 8}, num_key_value_heads=2, max_position_embeddings=64)
    elif family == "llama_mqa":           # multi-query: one kv head, held by every rank
        cfg = tfm.LlamaConfig(**common, num_key_value_heads=1, max_position_embeddings=64)
    elif family == "qwen2":
        cfg = tfm.Qwen2Config(**common, num_key_value_heads=4, max_position_embeddings=64)
    elif family == "mistral":
        cfg = tfm.MistralConfig(**common, num_key_value_heads=4, max_position_embeddings=64, sliding_window=None)
    elif family == "qwen2_sliding":       # per-layer types: layers >= max_window_layers use a 4-token window
        cfg = tfm.Qwen2Config(**common, num_key_value_heads=4, max_position_embeddings=64, use_sliding_window=True,
                              sliding_window=4, max_window_layers=overrides.pop("max_window_layers", 2))
    elif family == "gemma":               # a scaled word embedding (x sqrt(hidden)) that must survive sharding
        cfg = tfm.GemmaConfig(**common, num_key_value_heads=4, head_dim=8, max_position_embeddings=64)
    elif family == "gemma2":              # scaled embedding, soft-capping, alternating sliding/full layers
        cfg = tfm.Gemma2Config(**common, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                               sliding_window=4, query_pre_attn_scalar=8)
    else:
        raise ValueError(f"unknown tiny family {family!r}")
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg.pad_token_id = 0
    return cfg


MODEL_CLASSES = {
    "bert": ("BertModel", "BertForSequenceClassification", "BertForMaskedLM", "BertLMHeadModel",
             "BertForTokenClassification", "BertForQuestionAnswering"),
    "gpt2": ("GPT2Model", "GPT2LMHeadModel", "GPT2ForSequenceClassification"),
    "llama": ("LlamaModel", "LlamaForCausalLM", "LlamaForSequenceClassification"),
    "llama_gqa": ("LlamaForCausalLM",),
    "llama_kv2": ("LlamaForCausalLM",),
    "llama_mqa": ("LlamaForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "gemma": ("GemmaForCausalLM",),
}


def build_model(class_name: str, config, seed: int = 0) -> torch.nn.Module:
    """Instantiate `transformers.<class_name>(config)` with seeded random weights (eager-free, fp32)."""
    torch.manual_seed(seed)
    config.is_decoder = class_name == "BertLMHeadModel"
    model = getattr(tfm, class_name)(config)
    return model.float()


def tiny_batch(class_name: str, config, batch: int = 4, seq: int = 8, seed: int = 1) -> dict:
    """Inputs (with labels matching the head) for one step; identical on every rank."""
    g = torch.Generator().manual_seed(seed)
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
