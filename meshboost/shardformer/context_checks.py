"""Context parallelism's checks, pure and the same on every rank before any collective: the modes of a
sequence axis of its own (`check_mode`), which models it runs (`is_causal_lm`, `check_context`: causal LMs
with sdpa or eager attention, no chunked or recurrent layers, heads divisible by tp x cp in all_to_all), and
which sequence lengths split (`check_length`). The attention and the input split are context.py's.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.shardformer.recurrent import refuse_context

ALL_TO_ALL = "all_to_all"
RING_ATTN = "ring_attn"
MODES = (ALL_TO_ALL, RING_ATTN)
OVER_TP = ("split_gather", "ring")       # sequence parallelism over the tp group (sequence.py)
WRAPPED = ("sdpa", "eager")


def check_mode(mode: str | None) -> str:
    """The context mode of a sequence axis of its own (cp_size > 1); the tp group's modes are refused, naming
    how to get them."""
    if mode in OVER_TP:
        raise ValueError(f"sequence_parallelism_mode={mode!r} splits the sequence over the tensor-parallel group "
                         "(ColossalAI's 'ring' is split_gather's layout with ring exchanges: the same numbers), so it "
                         "takes no cp_size (ColossalAI's sp_size): pass cp_size=1 (or None) with tp_size > 1; with "
                         f"cp_size > 1 use one of {MODES}")
    if mode not in MODES:
        raise ValueError(f"sequence_parallelism_mode={mode!r} with cp_size > 1 (ColossalAI's sp_size); expected one "
                         f"of {MODES}")
    return mode


def is_causal_lm(model: nn.Module) -> bool:
    """A causal LM as transformers itself lists them (the classes AutoModelForCausalLM builds: every
    *ForCausalLM, GPT-2's GPT2LMHeadModel, ...) whose attention layers do not say they are not causal
    (BertLMHeadModel without is_decoder, cross-attention). Pure."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = type(model).__name__
    listed = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    if name.endswith("ForCausalLM"):
        return True
    # the other listed heads (GPT2LMHeadModel, BertLMHeadModel, multimodal ones): causal when no attention layer
    # says it is not (a vision tower's or an encoder's would)
    return name in listed and not any(getattr(m, "is_causal", True) is False for m in model.modules()
                                      if "Attention" in type(m).__name__)


def check_context(model: nn.Module, cp_size: int, tp_size: int, mode: str = ALL_TO_ALL) -> str:
    """The attention implementation the mode wraps, or an error naming the value and the fix. Pure."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if config is None or not is_causal_lm(model):
        raise NotImplementedError(f"cp_size={cp_size} (ColossalAI's sp_size): context parallelism runs causal LMs "
                                  "(a model transformers' AutoModelForCausalLM builds, with causal attention); "
                                  f"{name} is not one. Use cp_size=1")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in WRAPPED:
        raise NotImplementedError(f"cp_size={cp_size} (ColossalAI's sp_size): {name} runs attn_implementation="
                                  f"{implementation!r}; the all_to_all mode wraps {WRAPPED}: build the model with "
                                  "attn_implementation='sdpa'")
    layer_types = set(getattr(text, "layer_types", None) or ())
    refuse_context(model, cp_size)       # layer_types alone misses Falcon-H1 ("hybrid") and untyped stacks
    chunk = getattr(text, "attention_chunk_size", None)
    if chunk or layer_types - {"full_attention", "sliding_attention"}:
        raise NotImplementedError(f"cp_size={cp_size} (ColossalAI's sp_size): {name} has chunked or other attention "
                                  f"layers (attention_chunk_size={chunk}, layer_types={sorted(layer_types)}), which "
                                  "context parallelism does not mask yet; use cp_size=1")
    heads = getattr(text, "num_attention_heads", None)
    if mode == ALL_TO_ALL and (not isinstance(heads, int) or (heads // tp_size) % cp_size):
        per_rank = heads // tp_size if isinstance(heads, int) else None
        raise ValueError(f"cp_size={cp_size} (ColossalAI's sp_size): {name}'s {heads} attention heads over "
                         f"tp_size={tp_size} leave {per_rank} per rank, not divisible by cp_size={cp_size} (each cp "
                         "rank attends for heads / (tp x cp) of them); choose sizes that divide the heads")
    return implementation


def check_length(length: int, size: int, mode: str) -> None:
    """A sequence of `length` tokens splits over `size` cp ranks in `mode` (2 size chunks for ring_attn)."""
    multiple = size if mode == ALL_TO_ALL else 2 * size
    if length % multiple:
        raise ValueError(f"sequence length {length} is not divisible by {multiple} (cp_size={size}, {mode}; "
                         f"ColossalAI's sp_size): pad the batch to a multiple of {multiple} (e.g. the collator's "
                         f"pad_to_multiple_of={multiple}, labels -100 there)")
