"""Tiny mixture-of-experts models for tests: one config per family (the sizes HF_MODELS.md lists as
fair on CPU: 2 layers, hidden 64, 4 heads, 4 experts, top-2), the causal LM built from it with seeded
weights, and batches of causal-LM inputs identical on every rank. No downloads."""

from __future__ import annotations

import copy

import torch
import transformers as tfm

COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=160,
              max_position_embeddings=64, intermediate_size=128, use_cache=False, tie_word_embeddings=False)

# family -> (config class, its settings beyond COMMON)
_FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),
    # shared experts and a dense first layer (first_k_dense_replace)
    "glm4_moe": ("Glm4MoeConfig", dict(head_dim=16, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                                       n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)),
    # multi-head latent attention, shared experts, a dense first layer
    "deepseek_v3": ("DeepseekV3Config", dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                             num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                             n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                                             qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                             rope_scaling=None)),
    # interleaved gate/up rows, expert biases, attention sinks and sliding windows (policies/gpt_oss.py)
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=32, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=8)),
    # the transposed packed layout ([E, H, 2I] / [E, I, H]) and a shared expert
    "llama4_text": ("Llama4TextConfig", dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
                                             num_experts_per_tok=1, interleave_moe_layer_step=1,
                                             attention_chunk_size=8)),
}
MOE_FAMILIES = tuple(_FAMILIES)


def moe_config(family: str, **overrides):
    """The tiny config of `family` (one of MOE_FAMILIES), with `overrides` (e.g. output_router_logits=True)."""
    name, settings = _FAMILIES[family]
    return getattr(tfm, name)(**{**COMMON, **settings, **overrides})


def build_causal_lm(config, seed: int = 0) -> torch.nn.Module:
    """The causal LM of `config` with seeded random weights, fp32."""
    torch.manual_seed(seed)
    return tfm.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def causal_batches(config, steps: int, batch: int = 4, seq: int = 8, seed: int = 5) -> list[dict]:
    """`steps` batches of input_ids and labels (a few labels ignored), the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)
        labels = ids.clone()
        labels[1, :3] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out
