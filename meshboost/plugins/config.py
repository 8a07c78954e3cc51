"""The settings a plugin composes, grouped into typed configs, and the one place that decides how
they combine.

Owns: `DDPConfig` (torch DDP's arguments), `HybridParallelConfig` (tensor-parallel size and
sharding, pipeline, precision and loss scaler, ZeRO (stages 1 and 2 meshboost's, stage 3 torch
FSDP2's, all in `ZeroConfig.stage`), DDP: each group validated by its own config, the combinations
here; the plugin's one constructor argument), and `dp_reducer`,
which decides once who averages the data-parallel gradients. Every check is pure: a bad setting
raises on every rank before any collective. Must not build groups or touch a model.
"""

from __future__ import annotations

import inspect
from dataclasses import InitVar, asdict, dataclass, field, replace

from torch.nn.parallel import DistributedDataParallel

from meshboost.distributed.dims import ParallelDims
from meshboost.optim import PrecisionConfig, ZeroConfig
from meshboost.pipeline import PipelineConfig
from meshboost.pipeline.normalization import MODES as NORMALIZATIONS
from meshboost.pipeline.normalization import TOKENS
from meshboost.plugins.router_bias import check_rate
from meshboost.plugins.router_statistics import GLOBAL, REPLICA
from meshboost.plugins.router_statistics import check_mode as check_router_statistics
from meshboost.shardformer import PipelineGradientCheckpointConfig, Policy, ShardConfig
from meshboost.shardformer.selective import SELECTIVE, check_checkpointing
from meshboost.shardformer.compile import CompileConfig
from meshboost.shardformer.context_checks import ALL_TO_ALL, check_mode as check_context_mode
from meshboost.shardformer.float8 import Float8Config
from meshboost.shardformer.offload import OffloadConfig
from meshboost.shardformer.sequence import check_mode as check_sequence_mode

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


def check_replicate(dp_replicate_size, zero_stage: int, cpu_offload: bool) -> None:
    """What HSDP (dp_replicate_size > 1) composes with (tp, cp, pp and ep: everything but ZeRO-1/2 and
    cpu_offload); pure, the same error on every rank. Whether it divides dp, and with ep the experts'
    dp / ep, is the mesh's check (it knows the world size)."""
    if not isinstance(dp_replicate_size, int) or isinstance(dp_replicate_size, bool) or dp_replicate_size < 1:
        raise ValueError(f"dp_replicate_size={dp_replicate_size!r} must be a positive integer (1: no HSDP)")
    if dp_replicate_size == 1:
        return
    if cpu_offload:
        raise NotImplementedError(f"dp_replicate_size={dp_replicate_size} with cpu_offload=True: HSDP is FSDP2's "
                                  "zero_stage=3, which HybridParallelPlugin keeps on the device (cpu_offload is ZeRO-1/2's "
                                  "host copy of the states); drop cpu_offload, or use dp_replicate_size=1")
    if zero_stage != 3:
        raise NotImplementedError(f"dp_replicate_size={dp_replicate_size} with zero_stage={zero_stage}: HSDP shards "
                                  "weights, gradients and optimizer states inside a replica group and all-reduces "
                                  "gradients across groups, which meshboost does with FSDP2; use zero_stage=3, or "
                                  "dp_replicate_size=1 (ZeRO-1/2 shard the states over every dp rank)")


DDP_BUCKET_CAP_MB = 25      # torch DDP's and ColossalAI's default bucket_cap_mb (the planner and compat read it)


@dataclass
class DDPConfig:
    """Arguments passed to `torch.nn.parallel.DistributedDataParallel` (see its documentation)."""

    broadcast_buffers: bool = False
    bucket_cap_mb: int = DDP_BUCKET_CAP_MB
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
    """Everything HybridParallelPlugin composes, and its one constructor argument: each field validates
    itself (its own config's `__post_init__`), `__post_init__` here the combinations. Build it with the
    configs of its parts, e.g. `HybridParallelConfig(tp_size=2, pp_size=2, zero=ZeroConfig(stage=1),
    precision=PrecisionConfig("bf16"), pipeline=PipelineConfig(num_microbatches=4))`.

    The layout is one record, `dims` (`distributed.dims.ParallelDims`: every axis degree, the
    context-parallel mode and the tp mode, Megatron sequence parallelism; dp is the rest of the world),
    which the mesh is built from and every reader asks. The keywords tp_size, pp_size, ep_size, cp_size,
    cp_mode, sequence_parallel and dp_replicate_size only build it (each overrides `dims`' value when
    given; `dataclasses.replace` keeps the record); `pipeline` holds the micro-batch and schedule knobs
    only, checked against `dims.pp` here (`PipelineConfig.check`), and `sharding` the sharder's knobs."""

    # tensor parallelism: every linear of the plan split over tp_size ranks
    tp_size: InitVar[int | None] = None
    # pipeline parallelism: the model cut into pp_size stages (its micro-batches and schedule: `pipeline`)
    pp_size: InitVar[int | None] = None
    # expert parallelism: the experts of every MoE layer split over ep_size of the data-parallel ranks
    # (ep divides dp; tensor parallelism, when tp_size > 1, cuts inside each expert: docs/moe.md)
    ep_size: InitVar[int | None] = None
    # context parallelism (ColossalAI's sp_size): every sequence split over cp_size ranks; cp_mode
    # "all_to_all" (Ulysses, shardformer/context.py; the default with cp_size > 1) or "ring_attn"
    cp_size: InitVar[int | None] = None
    cp_mode: InitVar[str | None] = None
    # Megatron sequence parallelism, a mode of the tp axis (ColossalAI's enable_sequence_parallelism with
    # split_gather): norms, dropouts and residuals hold 1/tp of the sequence (docs/sequence_parallel.md)
    sequence_parallel: InitVar[bool | None] = None
    # HSDP (zero_stage=3): the data-parallel ranks split into dp_replicate_size replica groups; FSDP2 shards
    # weights, gradients and states inside a group and all-reduces gradients across groups (docs/fsdp.md)
    dp_replicate_size: InitVar[int | None] = None
    # the layout's one record, built from the keywords above (or passed whole; dp None: the rest of the world)
    dims: ParallelDims | None = None
    sharding: ShardConfig = field(default_factory=ShardConfig)      # its process group is set from the mesh
    custom_policy: Policy | None = None                             # instead of the family's table
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    # stages 1 and 2: meshboost's ZeroOptimizer; 3: weights, gradients and optimizer states sharded over
    # dp by torch FSDP2 (plugins/hybrid_zero3.py; the bucket settings do not apply)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    # how many layers of each stage run under HF activation checkpointing once it is on
    gradient_checkpoint: PipelineGradientCheckpointConfig | None = None
    # turn HF activation checkpointing on at boost: "full" (whole blocks recomputed), "selective" (matmul and
    # attention outputs kept, the cheap ops recomputed: shardformer/selective.py) or None (the model's own)
    checkpointing: str | None = None
    # the tensors each transformer block saves for its backward kept in host memory (True: the defaults;
    # with checkpointing, the checkpointed inputs only: shardformer/offload.py, docs/optimizations.md)
    activation_offload: OffloadConfig | None = None
    # DDP's gradient buckets all-reduced in fp8 (CUDA, tp_size=1, pp_size=1, zero stage 0; lossy by design)
    fp8_communication: bool = False
    # Agree over tp (and pp) that every rank was fed the same batch: on every call ("always"), the
    # "first", or "never".
    check_inputs: str = "always"
    # "tokens": the single-process objective over micro-batches and dp ranks; "microbatch": ColossalAI's
    # mean of micro-batch means (meshboost.pipeline.normalization).
    loss_normalization: str = TOKENS
    # The router's load-balancing loss over dp replicas: "replica" (each replica's own, DDP's semantics) or
    # "global" (routing statistics all-gathered over dp: the whole batch's; plugins/router_statistics.py)
    router_statistics: str = REPLICA
    # regional compile: each transformer block compiled by torch.compile after sharding (True: the
    # defaults; shardformer/compile.py, docs/compile.md)
    compile: CompileConfig | None = None
    # float8 training of the linears through torchao (ColossalAI's use_fp8; True: the defaults;
    # shardformer/float8.py, docs/compile.md)
    float8: Float8Config | None = None
    # DeepSeek-V3's auxiliary-loss-free balancing: every step each router's e_score_correction_bias moves by
    # rate * sign(mean load - expert load) over the global batch (0: off; plugins/router_bias.py)
    moe_router_bias_update_rate: float = 0.0
    # zero_stage=3: free each unit's gathered weights after its forward (FSDP2's reshard_after_forward). None:
    # True without pipeline parallelism; False with it, so a stage gathers its weights once per step, not once
    # per micro-batch (meshboost/fsdp/pipeline.py)
    reshard_after_forward: bool | None = None

    def __post_init__(self, tp_size, pp_size, ep_size, cp_size, cp_mode, sequence_parallel, dp_replicate_size):
        self.compile = CompileConfig.of(self.compile)
        self.float8 = Float8Config.of(self.float8)
        self.activation_offload = OffloadConfig.of(self.activation_offload)
        if self.activation_offload is not None and self.compile is not None:
            raise NotImplementedError(f"activation_offload with compile={self.compile!r}: the offload's saved-tensor "
                                      "hooks around a compiled block are not tested exact; pass compile=None with "
                                      "activation_offload, or activation_offload=None with compile")
        if self.check_inputs not in CHECK_INPUTS:
            raise ValueError(f"check_inputs={self.check_inputs!r}; expected one of {CHECK_INPUTS}")
        check_router_statistics(self.router_statistics)
        if self.loss_normalization not in NORMALIZATIONS:
            raise ValueError(f"loss_normalization={self.loss_normalization!r}; expected one of {NORMALIZATIONS}")
        for name, kind in (("sharding", ShardConfig), ("pipeline", PipelineConfig), ("precision", PrecisionConfig),
                           ("zero", ZeroConfig), ("ddp", DDPConfig)):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"HybridParallelConfig({name}={getattr(self, name)!r}): pass a {kind.__name__}")
        self.dims = self._layout(dict(tp=tp_size, pp=pp_size, ep=ep_size, cp=cp_size, cp_mode=cp_mode,
                                      sequence_parallel=sequence_parallel, dp_replicate=dp_replicate_size))
        self.pipeline.check(self.dims.pp)       # where the record and the pipeline's knobs meet
        self._check_sharding()
        tp = self.dims.tp
        if tp > 1 and not self.sharding.enable_tensor_parallelism:
            raise ValueError(f"tp_size={tp} with enable_tensor_parallelism=False would leave the model whole "
                             f"on {tp} ranks computing the same thing; pass tp_size=1 (those ranks then "
                             "become data-parallel replicas) or enable tensor parallelism")
        if self.custom_policy is not None and not isinstance(self.custom_policy, Policy):
            raise TypeError(f"custom_policy must be a meshboost.shardformer.Policy, got "
                            f"{type(self.custom_policy).__name__}")
        if self.gradient_checkpoint is not None and not isinstance(self.gradient_checkpoint,
                                                                   PipelineGradientCheckpointConfig):
            raise TypeError(f"gradient_checkpoint_config={self.gradient_checkpoint!r}: pass a "
                            "meshboost.shardformer.PipelineGradientCheckpointConfig")
        check_checkpointing(self.checkpointing)
        if self.checkpointing == SELECTIVE and self.compile is not None:
            raise ValueError(f"checkpointing='selective' with compile={self.compile!r}: inductor's compiled blocks "
                             "fail torch's selective-checkpoint check in the backward (a cached tensor mutated); "
                             "pass checkpointing='full' with compile, or compile=None with 'selective'")
        self.fp8_communication = bool(self.fp8_communication)
        self.moe_router_bias_update_rate = check_rate(self.moe_router_bias_update_rate)
        self._check_combinations()

    def _layout(self, given: dict) -> ParallelDims:
        """`dims` with the keywords `given` (those not None) over it; cp's mode defaulted ("all_to_all")
        and checked. Pure."""
        dims = ParallelDims() if self.dims is None else self.dims
        if not isinstance(dims, ParallelDims):
            raise TypeError(f"HybridParallelConfig(dims={dims!r}): pass a meshboost.distributed.ParallelDims")
        given = {axis: n for axis, n in given.items() if n is not None}
        if given.get("cp") == 1 and "cp_mode" not in given:     # cp switched off (dataclasses.replace): no mode
            given["cp_mode"] = None
        dims = replace(dims, **given)
        if dims.cp > 1:
            dims = replace(dims, cp_mode=check_context_mode(dims.cp_mode or ALL_TO_ALL))
        return dims

    def _check_combinations(self) -> None:
        stage, zero, dims = self.zero.stage, self.zero, self.dims
        if self.reshard_after_forward is not None and stage != 3:
            raise ValueError(f"reshard_after_forward={self.reshard_after_forward} is FSDP2's setting, but "
                             f"zero_stage={stage!r}; set zero_stage=3, or leave reshard_after_forward=None")
        check_replicate(dims.dp_replicate, stage, zero.cpu_offload)
        if zero.communication_dtype not in (None, self.precision.dtype) and not zero.partitioned_by_optimizer:
            raise ValueError(f"communication_dtype={zero.communication_dtype} sets the dtype of ZeRO's gradient "
                             f"reduce-scatter, but zero_stage={stage!r} (DDP and the pipeline reduce in the working "
                             f"precision, {self.precision.precision!r}); set zero_stage=1 or 2, or pass "
                             "communication_dtype=None")
        self._check_context(stage)
        if self.router_statistics == GLOBAL and dims.pp > 1:
            raise NotImplementedError(f"router_statistics='global' with pp_size={dims.pp}: each stage "
                                      "holds only its layers' router logits; use router_statistics='replica' with "
                                      "pipeline parallelism")
        if dims.ep > 1 and self.fp8_communication:
            raise NotImplementedError(f"fp8_communication=True with ep_size={dims.ep}: meshboost compresses only "
                                      "DDP's dense all-reduce without expert parallelism; drop one of them")
        if self.float8 is not None and dims.tp > 1 and dims.cp > 1:
            raise NotImplementedError(f"float8 with tp_size={dims.tp} and cp_size={dims.cp}: a row-parallel "
                                      "input's scale would need its amax agreed over the tp and cp ranks together, "
                                      "which meshboost does not test; use float8 with tp_size=1 (context parallelism) "
                                      "or cp_size=1 (tensor parallelism, with or without enable_sequence_parallelism)")
        layout = (dims.tp, dims.pp, stage)
        if self.fp8_communication and layout != (1, 1, 0):
            raise NotImplementedError(f"fp8_communication=True with (tp_size, pp_size, zero_stage)={layout}: meshboost "
                                      "compresses only DDP's data-parallel gradient all-reduce (tp_size=1, pp_size=1, "
                                      "zero_stage=0); tensor-parallel, pipeline and ZeRO traffic runs in the working "
                                      "precision. Drop the argument, or use that layout")

    def _check_sharding(self) -> None:
        """The sharding config carries knobs only: its sequence-parallel switch is the record's
        (`dims.sequence_parallel`, which the plugin's ShardConfig reads through the mesh), so one set there
        is refused with the fix; the knobs that pair with the mode are checked against the record."""
        sharding, sequence = self.sharding, self.dims.sequence_parallel
        given = sharding.enable_sequence_parallelism
        if given is not None:
            if given or sequence:
                raise ValueError(f"HybridParallelConfig(sharding=ShardConfig(enable_sequence_parallelism={given})): "
                                 "Megatron sequence parallelism is a mode of the layout record's tp axis, set once: "
                                 "pass HybridParallelConfig(sequence_parallel=True, ...) (or dims=ParallelDims(..., "
                                 "sequence_parallel=True)) and leave ShardConfig's switch unset")
            self.sharding = sharding = replace(sharding, enable_sequence_parallelism=None)
        if sharding.enable_sequence_overlap and not sequence:
            raise ValueError("enable_sequence_overlap=True needs enable_sequence_parallelism=True (meshboost's "
                             "HybridParallelConfig(sequence_parallel=True)): it overlaps sequence parallelism's "
                             "collectives; without it, column-parallel input gradients are all-reduced overlapped anyway")
        if sequence:
            check_sequence_mode(sharding.sequence_parallelism_mode)

    def _check_context(self, stage: int) -> None:
        cp = self.dims.cp
        if cp == 1:
            return
        if self.router_statistics == GLOBAL or self.fp8_communication:
            raise NotImplementedError(f"cp_size={cp} with router_statistics='global' or fp8_communication "
                                      "is not supported; drop them")
        if self.loss_normalization != TOKENS:
            raise NotImplementedError(f"cp_size={cp} with loss_normalization={self.loss_normalization!r}: "
                                      "the loss of a split sequence is normalised by its labelled tokens; use 'tokens'")

    @property
    def zero_stage(self) -> int:
        return self.zero.stage

    @classmethod
    def of(cls, tp_size: int = 1, pp_size: int = 1, zero_stage: int = 0, precision: str = "fp32", ep_size: int = 1,
           compile=None, moe_router_bias_update_rate: float = 0.0, dp_replicate_size: int = 1):
        """The config of the plugin's shortcuts (`HybridParallelPlugin(tp_size=2, ep_size=2, zero_stage=1,
        precision="fp16", compile=True)`): every other setting at its default."""
        return cls(tp_size=tp_size, pp_size=pp_size, ep_size=ep_size,
                   precision=PrecisionConfig(precision), zero=ZeroConfig(stage=zero_stage), compile=compile,
                   moe_router_bias_update_rate=moe_router_bias_update_rate, dp_replicate_size=dp_replicate_size)
