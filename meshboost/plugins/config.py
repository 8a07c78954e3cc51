"""The settings a plugin composes, grouped into typed configs, and the one place that decides how
they combine.

Owns: `DDPConfig` (torch DDP's arguments), `HybridParallelConfig` (tensor-parallel size and
sharding, pipeline, precision and loss scaler, ZeRO (stages 1 and 2 meshboost's, stage 3 torch
FSDP2's), DDP: each group validated by its own config, the combinations here), and `dp_reducer`,
which decides once who averages the data-parallel gradients. Every check is pure: a bad setting
raises on every rank before any collective. Must not build groups or touch a model.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field

from torch.nn.parallel import DistributedDataParallel

from meshboost.optim import PrecisionConfig, ZeroConfig
from meshboost.pipeline import PipelineConfig
from meshboost.pipeline.normalization import MODES as NORMALIZATIONS
from meshboost.pipeline.normalization import TOKENS
from meshboost.shardformer import Policy, ShardConfig

# Who averages gradients over the data-parallel group; exactly one of them does, decided by `dp_reducer`.
NO_REDUCTION = "none"        # dp_size == 1
DDP = "ddp"                  # torch DDP around the model, during backward
PIPELINE = "pipeline"        # one flat all-reduce after the pipeline schedule (DDP cannot wrap a stage)
ZERO = "zero"                # the ZeRO optimizer reduce-scatters (stage 1: at step, or each backward with
                             # overlap; stage 2: every backward, with pp once per pipeline step)
FSDP = "fsdp"                # zero_stage=3: torch FSDP2 reduce-scatters during backward (plugins/hybrid_zero3.py)


# check_inputs: the tp (and pp) ranks were fed the same batch on every call (the default), the first, or never
# (plugins/input_checks.py runs the check; docs/reliability.md states its cost).
CHECK_INPUTS = ("always", "first", "never")


def dp_reducer(dp_size: int, pp_size: int, zero_stage: int) -> str:
    """Who reduces the data-parallel gradients, decided once for a plugin."""
    if zero_stage == 3:
        return FSDP
    if zero_stage > 0:
        return ZERO
    if dp_size == 1:
        return NO_REDUCTION
    return PIPELINE if pp_size > 1 else DDP


@dataclass
class DDPConfig:
    """Arguments passed to `torch.nn.parallel.DistributedDataParallel` (see its documentation)."""

    broadcast_buffers: bool = False
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False

    def __post_init__(self):
        if not isinstance(self.bucket_cap_mb, (int, float)) or self.bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb!r} must be a positive number of megabytes")

    def kwargs(self) -> dict:
        """The arguments for this torch's DDP: from torch 2.13 `forward_sync_buffers` replaces the
        deprecated `broadcast_buffers` (same per-forward meaning; buffers are then always synced
        once at construction, which only copies rank 0's identical buffers)."""
        out = asdict(self)
        if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
            out["forward_sync_buffers"] = out.pop("broadcast_buffers")
        return out


@dataclass
class HybridParallelConfig:
    """Everything HybridParallelPlugin composes; each field validates itself, `__post_init__` the
    combinations."""

    tp_size: int = 1
    sharding: ShardConfig = field(default_factory=ShardConfig)      # its process group is set from the mesh
    custom_policy: Policy | None = None                             # instead of the family's table
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)            # stage 0 when fully_sharded
    # zero_stage=3: weights, gradients and optimizer states sharded over dp by torch FSDP2
    # (ZeroConfig covers meshboost's own stages 1 and 2 only).
    fully_sharded: bool = False
    ddp: DDPConfig = field(default_factory=DDPConfig)
    # Agree over tp (and pp) that every rank was fed the same batch: on every call ("always"), the
    # "first", or "never".
    check_inputs: str = "always"
    # "tokens": the single-process objective over micro-batches and dp ranks; "microbatch": ColossalAI's
    # mean of micro-batch means (meshboost.pipeline.normalization).
    loss_normalization: str = TOKENS

    def __post_init__(self):
        if self.check_inputs not in CHECK_INPUTS:
            raise ValueError(f"check_inputs={self.check_inputs!r}; expected one of {CHECK_INPUTS}")
        if self.loss_normalization not in NORMALIZATIONS:
            raise ValueError(f"loss_normalization={self.loss_normalization!r}; expected one of {NORMALIZATIONS}")
        if not isinstance(self.tp_size, int) or isinstance(self.tp_size, bool) or self.tp_size < 1:
            raise ValueError(f"tp_size={self.tp_size!r} must be a positive integer")
        if self.custom_policy is not None and not isinstance(self.custom_policy, Policy):
            raise TypeError(f"custom_policy must be a meshboost.shardformer.Policy, got "
                            f"{type(self.custom_policy).__name__}")
        if self.fully_sharded:
            if self.zero.stage != 0:
                raise ValueError(f"fully_sharded=True (zero_stage=3) with ZeroConfig(stage={self.zero.stage}); "
                                 "pass ZeroConfig(stage=0): FSDP2 does the sharding")
            if self.pipeline.pp_size > 1:
                raise NotImplementedError(
                    f"zero_stage=3 with pp_size={self.pipeline.pp_size}: FSDP2 would gather and reduce every weight "
                    "once per micro-batch on each stage (ColossalAI's HybridParallelPlugin allows zero_stage 0, 1, 2 "
                    "only); use pp_size=1 with zero_stage=3, or zero_stage=1 with pipeline parallelism")

    @property
    def pp_size(self) -> int:
        return self.pipeline.pp_size

    @property
    def zero_stage(self) -> int:
        return 3 if self.fully_sharded else self.zero.stage
