"""The shrunk copy of a user's config that `python -m meshboost.check` runs on one machine's CPU.

Owns: `shrink(config, layout)` -> (shrunk config, the "shrunk: ..." lines saying what changed). Kept as
the user's: the head counts and head_dim (written out when the config only derives it, so attention keeps
its per-rank shapes), every field the layout does not size. Reduced: the layers to what the pipeline
needs (at least pp x model chunks, one kept layer of each kind the per-layer lists name:
`testing.tiny_configs.cut_layers`; dense-before-MoE counts and MLP-only lists kept with one of each), the
experts to a multiple of ep at least twice top-k (the router still picks a subset), the widths (hidden,
intermediate, MoE and shared expert intermediate) each divided by the largest factor that keeps it
divisible by tp (and 2 tp) exactly where the real one is, the vocabulary to 256, a sliding window to 8
(the check's 16-token sequences cross it, as the real ones cross the real window), dropouts off.
Must not build or run models (run.py).
"""

from __future__ import annotations

from meshboost.plan.planner import MOE_FIELDS, TOP_K_FIELDS
from meshboost.testing.tiny_configs import DROPOUTS, cut_layers

WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
          "shared_experts_intermediate_size", "q_lora_rank", "kv_lora_rank")   # latent ranks: whole on every rank
MIN_WIDTH = 64          # the shrunk hidden size aims no lower (and no lower than 8 per tp rank)
VOCAB = 256
MIN_EXPERTS = 4
SLIDING_WINDOW = 8      # the check runs 16 tokens per sequence (x cp): a window they cross


def _factor(width: int, divisors: tuple, low: int) -> int:
    """The largest factor of `width` leaving it >= `low` and as divisible by each of `divisors` as it was."""
    for f in sorted((d for d in range(1, width + 1) if width % d == 0), reverse=True):
        if width // f >= low and all((width % d == 0) == ((width // f) % d == 0) for d in divisors):
            return f
    return 1


def _widths(fields: dict, alias: dict, tp: int, overrides: dict, lines: list, hidden_free: bool) -> None:
    """hidden_free: the model reads head_dim from the config (else the hidden size stays, as the heads need)."""
    hidden_key = alias.get("hidden_size", "hidden_size")
    heads_key = alias.get("num_attention_heads", "num_attention_heads")
    heads, hidden = fields.get(heads_key), fields.get(hidden_key)
    keys = [alias.get(k, k) for k in WIDTHS]
    if hidden_free:
        if fields.get("head_dim") is None and isinstance(heads, int) and isinstance(hidden, int):
            overrides["head_dim"] = hidden // heads        # kept: the attention's shapes stay the user's
    elif isinstance(heads, int):       # head_dim derived from the hidden size: the hidden size stays
        keys.remove(hidden_key)
        lines.append(f"kept: {hidden_key} {hidden} (this model derives head_dim from it)")
    widths = {k: fields[k] for k in keys if isinstance(fields.get(k), int) and not isinstance(fields[k], bool)
              and fields[k] > 0}
    if not widths:
        return
    changed = []
    for k, w in widths.items():     # each its own factor: the hidden size to MIN_WIDTH, the MLPs' to a quarter
        # the hidden size as divisible by the heads as it was too (configs validate hidden % heads)
        by = (tp, 2 * tp) + ((heads,) if k == hidden_key and isinstance(heads, int) else ())
        f = _factor(w, by, max(MIN_WIDTH if k == hidden_key else MIN_WIDTH // 4, 8 * tp))
        if f > 1:
            overrides[k] = w // f
            changed.append(f"{k} {w} -> {w // f}")
    if changed:
        lines.append("shrunk: " + ", ".join(changed) + f" (each as divisible by tp={tp} and {2 * tp} as it was)")


def _experts(fields: dict, ep: int, overrides: dict, lines: list) -> None:
    top_key = next((k for k in TOP_K_FIELDS if isinstance(fields.get(k), int)), None)
    top_k = fields[top_key] if top_key else 1
    for key in MOE_FIELDS:
        n = fields.get(key)
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            continue
        # a multiple of ep, twice top-k (the router still picks a subset)
        want = -(-max(MIN_EXPERTS, 2 * top_k, ep) // ep) * ep
        if want < n:
            overrides[key] = want
            lines.append(f"shrunk: {key} {n} -> {want} (top-k {top_k} kept: the router picks a subset; ep={ep} "
                         "divides it)")
            for group_key in ("n_group", "topk_group"):             # grouped routing: one group
                if isinstance(fields.get(group_key), int) and fields[group_key] > 1:
                    overrides[group_key] = 1
                    lines.append(f"shrunk: {group_key} {fields[group_key]} -> 1")


def _layers(fields: dict, alias: dict, layers: int, overrides: dict, lines: list) -> None:
    """At least `layers` layers, one of each kind; the fields counting dense layers before the MoE ones, or
    listing MLP-only layers, keep one dense and one MoE layer."""
    layers_key = alias.get("num_hidden_layers", "num_hidden_layers")
    if layers_key not in fields and "num_layers" in fields:
        layers_key = "num_layers"
    real = fields.get(layers_key)
    dense_first = fields.get("first_k_dense_replace")
    only = fields.get("mlp_only_layers")
    layers = max(layers, 2)     # a boundary between layers (and one dense, one MoE layer where they mix)
    cut_layers(fields, alias, {"num_hidden_layers": layers}, overrides)
    if isinstance(dense_first, int) and dense_first > 0:
        overrides["first_k_dense_replace"] = 1
    if only:
        overrides["mlp_only_layers"] = [0]
    if isinstance(fields.get("decoder_sparse_step"), int) and fields["decoder_sparse_step"] > 1:
        overrides["decoder_sparse_step"] = 2
    if overrides.get(layers_key, real) != real:
        kinds = sorted({k for k, v in overrides.items() if isinstance(v, list) and isinstance(real, int)
                        and isinstance(fields.get(k), list) and len(fields[k]) == real})
        lines.append(f"shrunk: {layers_key} {real} -> {overrides[layers_key]}"
                     + (f" (one of each kind in {', '.join(kinds)})" if kinds else ""))


def _head_dims(config) -> set:
    """The head_dim of every module of the model of `config` that has one (built on meta)."""
    from meshboost.plan.model import build_meta_model
    return {m.head_dim for m in build_meta_model(config).modules() if isinstance(getattr(m, "head_dim", None), int)}


def shrink(config, layout):
    """(the shrunk config, lines) for running `layout` (a plan.Layout) on CPU: see the module docstring.
    The hidden size shrinks only where the model, built on meta, keeps every module's head_dim."""
    real = _head_dims(config)
    shrunk, lines = _shrink(config, layout, hidden_free=True)
    try:
        same = _head_dims(shrunk) == real
    except (ValueError, TypeError, AttributeError):     # e.g. GPT-2: the hidden size must be heads x head_dim
        same = False
    if not same:
        shrunk, lines = _shrink(config, layout, hidden_free=False)
    return shrunk, lines


def _shrink(config, layout, hidden_free: bool):
    fields = config.to_dict()
    alias = dict(getattr(config, "attribute_map", None) or {})
    overrides: dict = {}
    lines: list[str] = []
    _layers(fields, alias, layout.pp * layout.num_model_chunks, overrides, lines)
    _experts(fields, layout.ep, overrides, lines)
    _widths(fields, alias, layout.tp, overrides, lines, hidden_free)
    vocab = fields.get("vocab_size")
    if isinstance(vocab, int) and vocab > VOCAB:
        overrides["vocab_size"] = VOCAB
        lines.append(f"shrunk: vocab_size {vocab} -> {VOCAB}")
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(fields.get(key), int) and fields[key] >= VOCAB:
                overrides[key] = VOCAB - 1
    window = fields.get("sliding_window")
    if isinstance(window, int) and not isinstance(window, bool) and window > SLIDING_WINDOW:
        overrides["sliding_window"] = SLIDING_WINDOW
        lines.append(f"shrunk: sliding_window {window} -> {SLIDING_WINDOW} (the check's sequences cross it)")
    overrides.update({k: 0.0 for k in DROPOUTS if isinstance(fields.get(k), float) and fields[k]})
    overrides["use_cache"] = False
    kept = [f"{k}={fields[k]}" for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
            if fields.get(k) is not None]
    if kept:
        lines.append("kept: " + ", ".join(kept))
    fields.pop("transformers_version", None)
    return type(config)(**{**fields, **overrides}), lines
