"""What a sharding policy is: a small table of data, no code paths per model head.

A `Policy` maps module-path patterns (relative to the model's *base* model, `*` = one path
component such as a layer index) to a registered style name (`meshboost.shardformer.styles`),
plus attribute fix-ups, the config fields that must divide by tp, the keyword arguments a block
input receives its hidden states through, and where the model's pipeline pieces live. Head
classes need no policy of their own: the input embedding and the LM head are found through
`get_input_embeddings()` / `get_output_embeddings()`, and any other head (a classifier, a QA span
head) stays replicated, so every `num_labels` works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from meshboost.shardformer.styles import DEFAULT_BLOCK_INPUT_KWARGS, attribute_rule, parse_style

# the keys of one pipeline segment (meshboost/pipeline/layout.py)
PIPELINE_LAYOUT_KEYS = ("embeddings", "layers", "tail", "stack", "carry", "counted_by", "shared_groups",
                        "embedding_inputs", "leading_layers")


@dataclass(frozen=True)
class Policy:
    """Tensor-parallel plan (and pipeline anatomy) of one model family.

    plan: pattern -> style, relative to the base model (`model.base_model`).
    attributes: pattern -> {attribute: rule}: per-rank values set on modules after sharding (never
        on the shared config, which rope/ALiBi code reads). A rule is a registered name ("divide")
        or a callable(path, attribute, value, tp_size) -> per-rank value that raises when the
        value cannot be split.
    divisible: config fields that must be divisible by tp_size.
    vocab_parallel: shard the input embedding and LM head over the vocabulary.
    block_input_kwargs: keyword arguments through which a block_input module receives tensors
        that feed its column-parallel linears (positional tensors always count).
    pipeline_layout: {"embeddings": paths, "layers": path of the layer ModuleList, "tail": paths},
        relative to the base model, or {"segments": [one such dict per layer stack, each with its
        "stack" path and optional "carry"]} for an encoder-decoder (meshboost/pipeline/layout.py);
        None reads transformers' `base_model_pp_plan`.
    check: callable(config, tp_size) raising ValueError for a configuration of the family the
        table cannot shard exactly (run before anything is modified).
    replicated: sub-models the policy leaves whole on every tp rank on purpose (a vision tower with no
        plan of its own), named once on rank 0 when the model is sharded.
    """

    name: str
    plan: dict[str, str]
    attributes: dict[str, dict[str, str | Callable]] = field(default_factory=dict)
    divisible: tuple[str, ...] = ("num_attention_heads",)
    vocab_parallel: bool = True
    block_input_kwargs: tuple[str, ...] = DEFAULT_BLOCK_INPUT_KWARGS
    pipeline_layout: dict | None = None
    check: Callable | None = None
    replicated: tuple[str, ...] = ()

    def __post_init__(self):
        for style in self.plan.values():
            parse_style(style)
        for rules in self.attributes.values():
            for rule in rules.values():
                attribute_rule(rule)
        if self.pipeline_layout is not None:
            entries = self.pipeline_layout.get("segments", [self.pipeline_layout])
            for entry in entries:
                unknown = set(entry) - set(PIPELINE_LAYOUT_KEYS)
                if unknown or "layers" not in entry:
                    raise ValueError(f"policy {self.name!r}: a pipeline_layout segment needs 'layers' and may have "
                                     f"{PIPELINE_LAYOUT_KEYS}; got {sorted(entry)}")


def pattern_to_regex(pattern: str) -> re.Pattern:
    """'layers.*.mlp.up_proj' -> a regex where '*' matches one dotted component."""
    return re.compile("^" + r"\.".join("[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")) + "$")


def plan_root(model: nn.Module) -> nn.Module:
    """The module a plan's paths are relative to: `model.base_model`, or, where a head's
    `base_model_prefix` names no attribute of it (Llama-4's text model under "language_model"), the
    head's `model` when that is a base model of the same config. A module of the user's own around one
    transformers model (ColossalChat's RewardModel: a base model under `model`, a value head beside it,
    sharded with `custom_policy=get_autopolicy(model.model)`): that model's root; the modules beside it
    stay whole."""
    if not hasattr(model, "base_model"):
        return plan_root(_wrapped_transformers_model(model))
    base = model.base_model
    inner = getattr(model, "model", None)
    if base is model and isinstance(inner, nn.Module) and getattr(inner, "config", None) is getattr(model, "config", 0):
        return inner
    return base


def _wrapped_transformers_model(model: nn.Module) -> nn.Module:
    """The one outermost transformers model (a module with `base_model`) inside `model`; refused otherwise."""
    found = []
    for name, module in model.named_modules():
        if name and hasattr(module, "base_model") and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    if len(found) != 1:
        raise ValueError(f"{type(model).__name__} is not a transformers model and holds "
                         f"{len(found)} ({', '.join(n for n, _ in found) or 'none'}): tensor parallelism shards a "
                         "transformers model, or a module of your own holding exactly one")
    return found[0][1]
