"""Benchmark models and data: a tiny-to-small HF config per family, built with seeded weights, and
one fixed synthetic batch. Owns nothing parallel; every configuration of a run starts from the same
weights and data, so first-step losses must agree across configurations."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import transformers as tfm

FAMILIES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertForSequenceClassification",
            "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class ModelSpec:
    """The model and batch of one benchmark run. `batch` is the global batch (split over dp)."""

    family: str = "gpt2"
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    seq: int = 128
    batch: int = 8
    vocab: int = 8192
    intermediate: int | None = None   # default 4 * hidden
    experts: int = 4                  # qwen3_moe: routed experts per layer (intermediate: each expert's)
    top_k: int = 2

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"--model {self.family!r}; expected one of {sorted(FAMILIES)}")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}")
        for name in ("layers", "hidden", "heads", "seq", "batch", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} {getattr(self, name)} must be >= 1")

    @property
    def class_name(self) -> str:
        return FAMILIES[self.family]

    @property
    def causal_lm(self) -> bool:
        return self.family in ("gpt2", "llama", "qwen3_moe")

    @property
    def ffn(self) -> int:
        return self.intermediate or 4 * self.hidden

    def as_dict(self) -> dict:
        return asdict(self)


def build_config(spec: ModelSpec):
    """A transformers config for `spec`; dropout off so every configuration does the same work."""
    h, n, layers, ffn, vocab = spec.hidden, spec.heads, spec.layers, spec.ffn, spec.vocab
    positions = max(spec.seq, 64)
    if spec.family == "gpt2":
        cfg = tfm.GPT2Config(vocab_size=vocab, n_embd=h, n_head=n, n_layer=layers, n_inner=ffn,
                             n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                             bos_token_id=None, eos_token_id=None)
    elif spec.family == "llama":
        cfg = tfm.LlamaConfig(vocab_size=vocab, hidden_size=h, num_attention_heads=n, num_key_value_heads=n,
                              num_hidden_layers=layers, intermediate_size=ffn, max_position_embeddings=positions)
    elif spec.family == "qwen3_moe":      # every layer an MoE layer, no shared expert; load balancing loss off
        cfg = tfm.Qwen3MoeConfig(vocab_size=vocab, hidden_size=h, num_attention_heads=n, num_key_value_heads=n,
                                 head_dim=h // n, num_hidden_layers=layers, intermediate_size=ffn,
                                 moe_intermediate_size=spec.intermediate or h, num_experts=spec.experts,
                                 num_experts_per_tok=spec.top_k, decoder_sparse_step=1, mlp_only_layers=[],
                                 max_position_embeddings=positions, output_router_logits=False)
    else:
        cfg = tfm.BertConfig(vocab_size=vocab, hidden_size=h, num_attention_heads=n, num_hidden_layers=layers,
                             intermediate_size=ffn, max_position_embeddings=positions, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, num_labels=2)
    cfg.pad_token_id = 0
    cfg.bos_token_id = cfg.eos_token_id = None     # GPT-2's 50256 would lie outside a small vocabulary
    return cfg


def build_model(spec: ModelSpec, seed: int = 0) -> torch.nn.Module:
    """The HF model of `spec` with seeded random weights, fp32, in training mode."""
    torch.manual_seed(seed)
    model = getattr(tfm, spec.class_name)(build_config(spec)).float()
    return model.train()


def make_batch(spec: ModelSpec, dp_size: int = 1, dp_rank: int = 0, seed: int = 1, device=None) -> dict:
    """This data-parallel replica's rows of one fixed global batch (labels match the head)."""
    if spec.batch % dp_size:
        raise ValueError(f"--batch {spec.batch} is not divisible by dp_size={dp_size}")
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, spec.vocab, (spec.batch, spec.seq), generator=g)
    labels = ids.clone() if spec.causal_lm else torch.randint(0, 2, (spec.batch,), generator=g)
    rows = slice(dp_rank * spec.batch // dp_size, (dp_rank + 1) * spec.batch // dp_size)
    batch = {"input_ids": ids[rows], "attention_mask": torch.ones_like(ids[rows]), "labels": labels[rows]}
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch
