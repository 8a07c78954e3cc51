"""ZeRO's settings: `ZeroConfig` (stage, buckets, overlap, offload, communication dtype, master weights),
checked when built, before any collective, and `bucket_elements` (ColossalAI's millions-of-elements unit).
ZeroOptimizer (zero.py) runs stages 1 and 2; stage 3 is FSDP2's, composed by the plugins.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshboost.optim.precision import PRECISION_DTYPES

DEFAULT_BUCKET_ELEMENTS = 12 * 1024 * 1024


def bucket_elements(millions, name: str = "reduce_bucket_size_in_m") -> int:
    """A bucket size given in millions of elements (ColossalAI's unit), as elements; `name` is the
    keyword the caller took it from, for the error."""
    if isinstance(millions, bool) or not (isinstance(millions, (int, float)) and millions > 0):
        raise ValueError(f"{name}={millions!r} must be a positive number (millions of elements)")
    return int(millions * 1024 * 1024)


@dataclass
class ZeroConfig:
    """ZeRO settings, checked when built (before any collective)."""

    stage: int = 0                       # 0: off (DDP or the pipeline reduces), 1: states, 2: + gradients,
                                         # 3: + weights (torch FSDP2, composed by HybridParallelPlugin)
    overlap_communication: bool = True   # reduce-scatter each bucket, asynchronously, as soon as backward has
                                         # produced all its gradients (ColossalAI's default too)
    reduce_bucket_size: int = DEFAULT_BUCKET_ELEMENTS     # elements per bucket (also the unit of overlap)
    cpu_offload: bool = False            # master shards and optimizer states in CPU memory; the inner step runs there
    communication_dtype: torch.dtype | None = None     # dtype of the gradient reduce-scatter (None: working dtype)
    master_weights: bool = True          # False: no fp32 masters, the inner optimizer steps working-dtype shards

    STAGES = (0, 1, 2, 3)
    OPTIMIZER_STAGES = (1, 2)            # the stages ZeroOptimizer partitions (3 is FSDP2's)

    def __post_init__(self):
        if isinstance(self.stage, bool) or self.stage not in self.STAGES:
            raise ValueError(f"zero_stage={self.stage!r}; expected one of {self.STAGES}")
        if not isinstance(self.reduce_bucket_size, int) or self.reduce_bucket_size < 1:
            raise ValueError(f"reduce_bucket_size={self.reduce_bucket_size!r} must be a positive number of elements")
        if self.communication_dtype is not None and self.communication_dtype not in PRECISION_DTYPES.values():
            raise ValueError(f"communication_dtype={self.communication_dtype!r}; expected None (the working dtype), "
                             "torch.float32, torch.float16 or torch.bfloat16")
        self.overlap_communication = bool(self.overlap_communication)
        self.cpu_offload, self.master_weights = bool(self.cpu_offload), bool(self.master_weights)
        if self.cpu_offload and not self.partitioned_by_optimizer:
            raise ValueError(f"cpu_offload=True moves ZeRO's fp32 masters and optimizer states to the CPU, but "
                             f"zero_stage={self.stage!r}; set zero_stage=1 or 2 (ColossalAI ignores it without ZeRO)")

    @property
    def partitioned_by_optimizer(self) -> bool:
        """Stages 1 and 2: ZeroOptimizer holds the partitions (and reduce-scatters the gradients)."""
        return self.stage in self.OPTIMIZER_STAGES
