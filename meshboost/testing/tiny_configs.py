"""Tiny configs for any model type: the default config of the installed transformers shrunk to a
few thousand parameters per layer (sizes that divide by 2 and 4, small vocab, two layers, small MoE)
and kept consistent: multi-head latent attention ranks, Mamba heads, multimodal rotary sections, one
kept layer of each kind the per-layer lists name, sub-configs shrunk too, TYPE_OVERRIDES for single
families. Owns the shrink only; the sweep (testing/sweep.py) builds, shards and compares the models,
and tests build their own tiny models from it (test_context_parallel's sweep configs).
"""

from __future__ import annotations

import copy

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            num_hidden_layers=2, vocab_size=160, max_position_embeddings=64, moe_intermediate_size=32,
            num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            shared_expert_intermediate_size=64, first_k_dense_replace=1, n_group=1, topk_group=1,
            use_cache=False, tie_word_embeddings=False,
            # sizes of single families the fields above miss: sparse-attention indexers, per-layer input
            # embeddings, linear-attention heads, shared experts
            index_head_dim=16, index_n_heads=2, index_topk=4, vocab_size_per_layer_input=160,
            hidden_size_per_layer_input=16, linear_head_dim=16, shared_experts_intermediate_size=64, rotary_dim=8,
            num_sliding_attention_heads=4, zero_expert_num=2)
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]
# Multi-head latent attention (configs with kv_lora_rank) over the 4 heads: q/k 8 plain + 8 rotary
# (16 plain where the type has no rotary part), v 16, as tests/shardformer/test_mla.py
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, qk_head_dim=16)
# Fields a default config may leave None that the model reads as numbers (DeepSeek-V2's and dots1's
# experts, Nemotron's kv heads, HunYuan's head_dim): given TINY's value (head_dim: hidden / heads)
NONE_READ = ("num_key_value_heads", "head_dim", "num_experts_per_tok", "n_routed_experts", "n_shared_experts",
             "num_experts", "n_group", "topk_group", "moe_intermediate_size")
# What the generic shrink cannot infer, per model type (applied last)
TYPE_OVERRIDES: dict[str, dict] = {
    # fields the default config leaves None (or empty) and the model reads
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse"]),
    "diffusion_gemma_text": dict(top_k_experts=2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),   # and one MoE layer
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=4,
                           indexer_compress_ratio=2),          # its indexed-attention layers' QSA indexer
    # fields the parent config sets on these sub-configs
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=64),
    "t5gemma2_text": dict(dropout_rate=0.0), "t5gemma2_decoder": dict(dropout_rate=0.0),
    "t5_gemma_module": dict(dropout_rate=0.0, is_decoder=False),
    # constraints between fields
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),  # blocks add up
    "dots3_note_text": dict(head_dim=16),          # its sliding-window layers: head_dim = qk_nope + qk_rope
    "glm5_next_text": dict(index_kpool=2),         # its indexer's top-k divides by the key pooling
    "deepseek_v4": dict(index_head_dim=64),        # the compressor's index heads hold the 64 rotary dims
    "kolibri1_1": dict(layer_types=["sliding_attention", "indexed_attention"], index_layers=[1], sliding_window=4,
                       kv_source_layers=[0, 1], index_topk=4, index_pool_size=16, index_compression=4,
                       index_num_heads=2, index_num_local_tokens=4, index_num_sink_tokens=2, mlp_only_layers=[0]),
    "step3p5": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4),  # always a window mask
    "ernie4_5_vl_moe_text": dict(moe_k=2, moe_num_experts=4, moe_intermediate_size=[32, 32], moe_num_shared_experts=1),
    # vision and audio adapters: the merged (2 x 2) vision width in, a small projection out
    "muse_glimmer": dict(out_hidden_size=256, projector_hidden_size=64),
    "muse_spark": dict(out_hidden_size=256, projector_hidden_size=64),
    "muse_spark_audio": dict(out_hidden_size=64),
    "dots3_note_vision_encoder": dict(adapter_in_dim=64, adapter_out_dim=64),
    # image tokens inside the tiny vocabulary (the multimodal model, with its projector, the plan's one entry)
    "llama4": dict(image_token_index=151, boi_token_index=152, eoi_token_index=153),
    # 4 x 4 patches; the pixel shuffle (ratio 0.5) makes the MLP input 4 x hidden
    "llama4_vision_model": dict(image_size=56, intermediate_size=256, vision_output_dim=64, projector_input_dim=64,
                                projector_output_dim=64),
}
DROPOUTS = ("hidden_dropout", "attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob",
            "dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "embedding_dropout", "mlp_dropout",
            "residual_dropout")


def _kept_layers(fields: dict, layers: int, n: int) -> list[int]:
    """The layers the tiny model keeps: the first of each kind every per-layer list names (attention
    types, dense / MoE, ...; kv-sharing producers and consumers apart), then the first ones up to n."""
    kinds = [v for v in fields.values() if isinstance(v, list) and len(v) == layers
             and all(x is None or isinstance(x, (str, bool)) for x in v)]
    shared = fields.get("num_kv_shared_layers")
    regions = [range(layers)]
    if isinstance(shared, int) and 0 < shared < layers:
        regions = [range(layers - shared), range(layers - shared, layers)]
    keep = set()
    for region in regions:
        keep.add(region[0])
        for v in kinds:
            seen = set()
            for i in region:
                if v[i] not in seen:
                    seen.add(v[i])
                    keep.add(i)
    for i in range(layers):
        if len(keep) >= n:
            break
        keep.add(i)
    return sorted(keep)


def _mrope_default(config_class) -> list[int] | None:
    """The multimodal rotary sections (`mrope_section`: temporal, height, width) the type's modeling
    module falls back on, or None when it uses no multimodal rotary embedding."""
    import importlib
    import re
    try:
        module = importlib.import_module(config_class.__module__.replace(".configuration_", ".modeling_"))
        with open(module.__file__) as f:
            source = f.read()
    except (ImportError, OSError):              # e.g. a type whose model lives in another family's module
        return None
    if "mrope_section" not in source:
        return None
    found = re.search(r"mrope_section\"?\s*,\s*\[\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\]", source)
    return [int(x) for x in found.groups()] if found else [16, 24, 24]


def _size_mrope(rope: dict, head_dim: int, partial: float | None, default: list[int]) -> None:
    """Size `mrope_section` in `rope` (flat or one entry per layer type) for `head_dim`: the sections
    add up to half the rotated dimension, in the proportions of the given (or default) sections."""
    per_type = bool(rope) and all(isinstance(v, dict) or v is None for v in rope.values())
    for entry in (rope.values() if per_type else [rope]):
        if entry is None:
            continue
        half = int(head_dim * (entry.get("partial_rotary_factor", partial) or 1.0)) // 2
        sections = list(entry.get("mrope_section") or default)
        if sum(sections) == half:
            continue
        exact = [x * half / sum(sections) for x in sections]
        sized = [int(x) for x in exact]
        for i in sorted(range(len(exact)), key=lambda i: sized[i] - exact[i])[:half - sum(sized)]:
            sized[i] += 1                       # the largest remainders, the first on a tie
        entry["mrope_section"] = sized



def _shrunk_sizes(fields: dict, alias: dict, shrink_head_dim: bool) -> dict:
    """TINY's sizes under the config's own names (only fields it has, with the type it gives them),
    dropouts off, numbers for fields left None, and the families whose sizes are tied to each other:
    multi-head latent attention (one kv head per head) and Mamba heads times their width."""
    tiny = {alias.get(k, k): v for k, v in TINY.items()}
    # only fields the config has, with the type it gives them (an int stays an int, a list a list)
    overrides = {k: v for k, v in tiny.items() if k in fields and type(fields[k]) is type(v)}
    overrides.update({k: [v] * len(fields[k]) for k, v in tiny.items()     # per-layer sizes (Gemma 3n's MLPs)
                      if isinstance(v, int) and isinstance(fields.get(k), list) and fields[k]
                      and all(isinstance(x, int) and not isinstance(x, bool) for x in fields[k])})
    overrides.update({k: 0.0 for k in DROPOUTS if isinstance(fields.get(k), float)})
    kv_key = alias.get("num_key_value_heads", "num_key_value_heads")
    for key in NONE_READ:
        if fields.get(alias.get(key, key), 0) is None:
            overrides[alias.get(key, key)] = TINY.get(key, HEAD_DIM)
    heads, hidden, head_dim = fields.get(alias.get("num_attention_heads", "num_attention_heads")), \
        fields.get(alias.get("hidden_size", "hidden_size")), fields.get("head_dim")
    if shrink_head_dim and isinstance(head_dim, int) and isinstance(heads, int) and isinstance(hidden, int) \
            and head_dim * heads == hidden:
        overrides["head_dim"] = HEAD_DIM
    if isinstance(fields.get("kv_lora_rank"), int):     # MLA: the latent expands to one key/value per head
        mla = dict(MLA, qk_rope_head_dim=0, qk_nope_head_dim=16) if fields.get("qk_rope_head_dim") == 0 else MLA
        overrides.update({k: v for k, v in mla.items() if k in fields and type(fields[k]) is type(v)})
        if kv_key in fields:
            overrides[kv_key] = TINY["num_attention_heads"]
        if isinstance(head_dim, int) and head_dim == fields.get("qk_rope_head_dim"):        # DeepSeek-V3
            overrides["head_dim"] = mla["qk_rope_head_dim"]
        elif isinstance(head_dim, int) and head_dim == fields.get("qk_rope_head_dim", 0) + fields.get(
                "qk_nope_head_dim", 0):                                                     # Mistral 4
            overrides["head_dim"] = mla["qk_rope_head_dim"] + mla["qk_nope_head_dim"]
    # Mamba heads times their width is the Mamba width (Bamba; Falcon-H1 sizes it by mamba_d_ssm)
    if isinstance(fields.get("mamba_n_heads"), int) and "mamba_d_ssm" not in fields:
        overrides["mamba_n_heads"] = 8
        if isinstance(fields.get("mamba_d_head"), int) and isinstance(fields.get("mamba_expand"), int):
            overrides["mamba_d_head"] = fields["mamba_expand"] * TINY["hidden_size"] // 8
    if isinstance(fields.get("mamba_n_groups"), int):      # groups tp=2 divides: the mixer splits by heads
        overrides["mamba_n_groups"] = 2
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(fields.get(key), int) and fields[key] >= TINY["vocab_size"]:
            overrides[key] = TINY["vocab_size"] - 1
    return overrides


def cut_layers(fields: dict, alias: dict, special: dict, overrides: dict) -> None:
    """Keep one layer of each kind (`_kept_layers`): the layer count, the kv-shared count, and every
    per-layer list or table follow the kept layers; a layer's own sizes shrink like the model's."""
    layers_key = alias.get("num_hidden_layers", "num_hidden_layers")
    if layers_key not in fields and "num_layers" in fields:        # LongCat-Flash
        layers_key = "num_layers"
    layers, n = fields.get(layers_key), special.get("num_hidden_layers", TINY["num_hidden_layers"])
    if isinstance(layers, int) and layers > n:
        keep = _kept_layers(fields, layers, n)
        overrides[layers_key] = len(keep)
        if isinstance(fields.get("num_kv_shared_layers"), int) and fields["num_kv_shared_layers"] > 0:
            overrides["num_kv_shared_layers"] = sum(i >= layers - fields["num_kv_shared_layers"] for i in keep)
        for key, value in fields.items():          # per-layer lists and tables follow the kept layers
            if isinstance(value, list) and len(value) == layers:
                overrides[key] = [value[i] for i in keep]
            elif key == "per_layer_config" and isinstance(value, dict):    # renumbered ("02" stays 2 digits)
                overrides[key] = {(str(new).zfill(len(k)) if isinstance(k, str) else new): value[k]
                                  for new, old in enumerate(keep) for k in value
                                  if str(k).isdigit() and int(k) == old}
    if isinstance(overrides.get("per_layer_config"), dict):   # a layer's own sizes shrink like the model's
        overrides["per_layer_config"] = {k: {f: overrides.get(f, v) for f, v in entry.items()}
                                         if isinstance(entry, dict) else entry
                                         for k, entry in overrides["per_layer_config"].items()}


def tiny_config(model_type: str, shrink_head_dim: bool = False):
    """The default config of `model_type` shrunk to TINY where it has the fields (under the names its
    `attribute_map` gives them; sub-configs too), kept consistent: multi-head latent attention with
    one kv head per head, per-layer lists cut to the kept layers (one layer of each kind), Mamba heads
    dividing the Mamba width, multimodal rotary sections adding up to the shrunk head_dim, and the
    TYPE_OVERRIDES of single families.
    shrink_head_dim: a head_dim that only restates hidden / heads (ESM-C, Helium) follows the shrink
    (tried when the plain shrink cannot run: other configs keep an independent head_dim)."""
    from transformers import CONFIG_MAPPING, PreTrainedConfig
    default = CONFIG_MAPPING[model_type]()
    fields = default.to_dict()
    alias = dict(getattr(default, "attribute_map", None) or {})
    overrides = _shrunk_sizes(fields, alias, shrink_head_dim)
    special = TYPE_OVERRIDES.get(model_type, {})
    cut_layers(fields, alias, special, overrides)
    kinds = {x for v in {**fields, **overrides}.values() if isinstance(v, list) for x in v if isinstance(x, str)}
    if "sliding_attention" in kinds and "sliding_window" in fields and fields["sliding_window"] is None:
        overrides["sliding_window"] = 4                # sliding layers need a window (Step-3.5)
    overrides.update(copy.deepcopy(special))
    mrope = _mrope_default(CONFIG_MAPPING[model_type])
    if mrope is not None and isinstance(overrides.get("rope_parameters", fields.get("rope_parameters")), dict):
        rope = copy.deepcopy(overrides.get("rope_parameters", fields.get("rope_parameters")))
        # the rotated head as far as the fields tell (HY-V4-VL validates its sections at construction);
        # sized again below from the config as built
        rotated = overrides.get("qk_rope_head_dim") or overrides.get("head_dim", fields.get("head_dim")) or HEAD_DIM
        _size_mrope(rope, rotated if isinstance(rotated, int) else HEAD_DIM, fields.get("partial_rotary_factor"), mrope)
        overrides["rope_parameters"] = rope
    kv_key = alias.get("num_key_value_heads", "num_key_value_heads")
    try:
        config = CONFIG_MAPPING[model_type](**{**fields, **overrides})
    except Exception:  # noqa: BLE001 - e.g. ESM-C: no grouped-query attention; retry with kv heads = heads
        if kv_key not in overrides:
            raise
        overrides[kv_key] = TINY["num_attention_heads"]
        config = CONFIG_MAPPING[model_type](**{**fields, **overrides})
    for name, sub in list(vars(config).items()):     # text, vision, audio, decoder ... configs shrink too
        if isinstance(sub, PreTrainedConfig) and sub.model_type in CONFIG_MAPPING:
            setattr(config, name, tiny_config(sub.model_type, shrink_head_dim))
    if mrope is not None and isinstance(getattr(config, "rope_parameters", None), dict):   # head_dim as built
        rotated = getattr(config, "qk_rope_head_dim", None) or getattr(config, "head_dim", None) \
            or config.hidden_size // config.num_attention_heads
        _size_mrope(config.rope_parameters, rotated, getattr(config, "partial_rotary_factor", None), mrope)
    return config
