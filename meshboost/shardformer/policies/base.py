"""What a sharding policy is: a small table of data, no code paths per model head.

A `Policy` maps module-path patterns (relative to the model's *base* model, `*` = one path
component such as a layer index) to a style name, plus attribute fix-ups and the config fields
that must divide by tp. Head classes need no policy of their own: the input embedding and the LM
head are found through `get_input_embeddings()` / `get_output_embeddings()`, and any other head
(a classifier, a QA span head) stays replicated, so every `num_labels` works.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Style names a plan may use.
COLWISE = "colwise"              # output features split; Megatron f on its input
ROWWISE = "rowwise"              # input features split; one all-reduce on its output
BLOCK_INPUT = "block_input"      # module whose input feeds only column-parallel linears: f once
STYLES = (COLWISE, ROWWISE, BLOCK_INPUT)
_FUSED = re.compile(r"colwise_fused\((\d+)\)$")   # e.g. GPT-2 c_attn [q|k|v]: colwise_fused(3)


def parse_style(style: str) -> tuple[str, int]:
    """("colwise", fused blocks) for a style string; raises on an unknown style."""
    m = _FUSED.match(style)
    if m:
        return COLWISE, int(m.group(1))
    if style in STYLES:
        return style, 1
    raise ValueError(f"unknown sharding style {style!r}; expected one of {STYLES} or 'colwise_fused(N)'")


@dataclass(frozen=True)
class Policy:
    """Tensor-parallel plan for one model family.

    plan: pattern -> style, relative to the base model (`model.base_model`).
    attributes: pattern -> {attribute: "divide"}: per-rank values set on modules after sharding
        (never on the shared config, which rope/ALiBi code reads).
    divisible: config fields that must be divisible by tp_size.
    vocab_parallel: shard the input embedding and LM head over the vocabulary.
    """

    name: str
    plan: dict[str, str]
    attributes: dict[str, dict[str, str]] = field(default_factory=dict)
    divisible: tuple[str, ...] = ("num_attention_heads",)
    vocab_parallel: bool = True

    def __post_init__(self):
        for pattern, style in self.plan.items():
            parse_style(style)


def pattern_to_regex(pattern: str) -> re.Pattern:
    """'layers.*.mlp.up_proj' -> a regex where '*' matches one dotted component."""
    return re.compile("^" + r"\.".join("[^.]+" if p == "*" else re.escape(p) for p in pattern.split(".")) + "$")
