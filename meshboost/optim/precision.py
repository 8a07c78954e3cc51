"""Training precision: the one table from precision names to dtypes ("fp32", "fp16", "bf16"), and
`PrecisionConfig`, the step's numerics every optimizer wrapper takes (working precision, clipping,
fp16's loss scale), checked when built, before any collective. Everything that turns a precision name
into a dtype reads PRECISION_DTYPES here (the booster's autocast, ZeRO's communication dtype, the
plugins, the planner), and every size of one reads PRECISION_BYTES (the planner's memory and traffic).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from meshboost.optim.grad_scaler import GradScalerConfig

PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# bytes per element of each precision, derived from the dtypes (the planner's sizes read this)
PRECISION_BYTES = {name: dtype.itemsize for name, dtype in PRECISION_DTYPES.items()}


def precision_of(dtype: torch.dtype) -> str | None:
    """The precision name of `dtype` (the inverse of PRECISION_DTYPES), None for a dtype meshboost does
    not train in."""
    return next((name for name, d in PRECISION_DTYPES.items() if d == dtype), None)


def check_precision(precision: str) -> torch.dtype:
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"precision={precision!r}; expected one of {tuple(PRECISION_DTYPES)}")
    return PRECISION_DTYPES[precision]


@dataclass
class PrecisionConfig:
    """Working precision and the step's numerics, checked when built (before any collective)."""

    precision: str = "fp32"       # working weights: "fp32" | "fp16" (loss-scaled) | "bf16"; masters are fp32
    max_norm: float = 0.0         # clip by the global gradient norm when > 0
    norm_type: float = 2.0        # 2.0 or float("inf")
    scaler: GradScalerConfig = field(default_factory=GradScalerConfig)    # fp16's dynamic loss scale

    def __post_init__(self):
        check_precision(self.precision)
        if not isinstance(self.max_norm, (int, float)) or self.max_norm < 0:
            raise ValueError(f"max_norm={self.max_norm!r} must be >= 0 (0 disables clipping)")
        if not isinstance(self.norm_type, (int, float)) or not (self.norm_type > 0 or math.isinf(self.norm_type)):
            raise ValueError(f"norm_type={self.norm_type!r} must be positive (2.0 or float('inf'))")

    @property
    def dtype(self) -> torch.dtype:
        return PRECISION_DTYPES[self.precision]


def precision_config(config) -> PrecisionConfig:
    """`config`, or the defaults for None; a precision name or anything else is refused with the fix."""
    if config is None:
        return PrecisionConfig()
    if not isinstance(config, PrecisionConfig):
        hint = f"PrecisionConfig({config!r})" if isinstance(config, str) else "PrecisionConfig(...)"
        raise TypeError(f"the optimizer wrapper takes a meshboost.optim.PrecisionConfig, got {config!r}; pass {hint}")
    return config
