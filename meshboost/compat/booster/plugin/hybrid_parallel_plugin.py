"""ColossalAI's path `booster.plugin.hybrid_parallel_plugin`: `HybridParallelPlugin` with ColossalAI's
flat keyword signature (its 51 keywords, in its order), a thin mapping onto meshboost's
`HybridParallelConfig`; `HybridParallelModule` is the model wrapper it returns from `boost`
(ColossalAI's tests check `isinstance(model, HybridParallelModule)` and call `model.unwrap()`).

Owns: `colossalai_config` (keywords -> config) and the refusals of ColossalAI keywords meshboost does
not implement. Every check is pure (the same error on every rank, after one agreement over the
arguments, before any other collective). Must not hold plugin behaviour: the class adds nothing but
its constructor (and ColossalAI's views of the mesh, `pg_mesh` and `stage_manager`) to
`meshboost.plugins.HybridParallelPlugin`.
"""

from __future__ import annotations

import dataclasses

import torch

from meshboost.cluster import PipelineStageManager, ProcessGroupMesh
from meshboost.distributed.agreement import agree_settings
from meshboost.optim import GradScalerConfig, PrecisionConfig, ZeroConfig, bucket_elements
from meshboost.pipeline import PipelineConfig
from meshboost.plugins import HybridParallelPlugin as CorePlugin
from meshboost.plugins.config import DDP_BUCKET_CAP_MB, DDPConfig, HybridParallelConfig, check_replicate
from meshboost.plugins.hybrid_parallel import HybridParallelModule
from meshboost.shardformer import PipelineGradientCheckpointConfig, Policy, ShardConfig
from meshboost.shardformer.optimizations import say

__all__ = ["HybridParallelPlugin", "HybridParallelModule", "colossalai_config"]


CONTEXT_MODES = ("all_to_all", "ring_attn")     # ColossalAI's modes over a sequence axis of their own


def _context(a: dict) -> tuple[int, str | None, bool, str | None]:
    """ColossalAI's sequence-parallel keywords as (cp_size, cp_mode, sequence_parallel: the record's tp mode,
    the ShardConfig's sequence_parallelism_mode), as ColossalAI reads them. The modes with an sp group of
    their own (all_to_all, ring_attn) become the context axis (meshboost's cp); with sp_size None or 1 that
    group holds one rank and splits nothing, so they run as no sequence parallelism at all (ColossalAI's
    numbers). split_gather and ColossalAI's "ring" (split_gather's layout with ring exchanges, the same
    numbers: ShardConfig runs it as split_gather) split the sequence over the tp group, the record's tp mode:
    an sp_size given with them is ignored (ColossalAI logs that it follows tp_size), and they need
    tp_size > 1 when an sp_size asks for a split (ColossalAI refuses tp_size 1)."""
    sp_size, mode, enabled = a["sp_size"], a["sequence_parallelism_mode"], a["enable_sequence_parallelism"]
    if enabled and mode in CONTEXT_MODES:
        if sp_size in (None, 1):
            say("meshboost: sequence_parallelism_mode=%r with sp_size=%r: a sequence group of one rank, nothing is "
                "split (as ColossalAI); pass sp_size > 1 to split every sequence over that many ranks", mode, sp_size)
            return 1, None, False, None
        return sp_size, mode, False, None
    if sp_size not in (None, 1):
        if not enabled:
            raise ValueError(f"sp_size={sp_size!r} with enable_sequence_parallelism=False: sp_size is the sequence "
                             "group of sequence parallelism; pass enable_sequence_parallelism=True with "
                             "sequence_parallelism_mode='all_to_all' or 'ring_attn', or drop sp_size (ColossalAI "
                             "refuses it too)")
        if mode is None:        # ColossalAI's plugin reads None as all_to_all here, its ShardConfig as split_gather
            raise ValueError(f"sp_size={sp_size!r} with sequence_parallelism_mode=None: name the mode, "
                             "'all_to_all' or 'ring_attn' (a sequence axis of sp_size ranks) or 'split_gather' (over "
                             "the tensor-parallel ranks, which ignores sp_size)")
        if a["tp_size"] == 1:
            raise ValueError(f"sp_size={sp_size!r} with sequence_parallelism_mode={mode!r} and tp_size=1: that mode "
                             "splits the sequence over the tensor-parallel ranks (its size follows tp_size, "
                             "ColossalAI refuses tp_size 1); for a sequence axis of its own pass "
                             f"sequence_parallelism_mode='all_to_all' (or 'ring_attn') with sp_size={sp_size}")
        say("meshboost: sp_size=%r is ignored with sequence_parallelism_mode=%r: the sequence is split over the "
            "tp_size=%d tensor-parallel ranks (as ColossalAI: sp_size follows tp_size)", sp_size, mode, a["tp_size"])
    return 1, None, bool(enabled), mode


def _refuse_unsupported(scheduler_nodes, dp_outside, overlap_allgather, inner_ring_size) -> None:
    """ColossalAI keywords meshboost does not implement: refused (pure, the same on every rank) with the
    meshboost way to get what they are for."""
    if scheduler_nodes is not None:
        raise NotImplementedError("scheduler_nodes= (the zero-bubble V schedule) is not supported; use "
                                  "pp_style='1f1b' or 'interleaved' without scheduler_nodes")
    if not dp_outside:
        raise NotImplementedError("dp_outside=False (pp as the outermost mesh axis) is not supported: meshboost's mesh "
                                  "is (dp, pp, tp), dp outermost and tp innermost; drop the argument")
    if overlap_allgather:
        raise NotImplementedError("overlap_allgather=True is not supported: ZeRO all-gathers the updated shards "
                                  "inside optimizer.step(), not during the next forward; drop the argument (training "
                                  "is the same); overlap_communication=True overlaps the gradient reduce-scatter with "
                                  "backward")
    if inner_ring_size is not None:
        raise NotImplementedError(f"inner_ring_size={inner_ring_size}: ColossalAI's double ring (an inner ring of "
                                  "ring attention inside each node) is not in meshboost; sequence_parallelism_mode="
                                  "'ring_attn' (keys and values all-gathered over the sp ranks) or 'all_to_all' with "
                                  "sp_size splits long sequences: drop inner_ring_size")


def colossalai_config(a: dict) -> HybridParallelConfig:
    """ColossalAI's HybridParallelPlugin keywords (`a`, every one of them) as meshboost's config."""
    _refuse_unsupported(a["scheduler_nodes"], a["dp_outside"], a["overlap_allgather"], a["inner_ring_size"])
    # before ZeroConfig, whose cpu_offload refusal at zero_stage=3 would point away from HSDP
    check_replicate(a["dp_replicate_size"], a["zero_stage"], a["cpu_offload"])
    cp_size, cp_mode, sequence_parallel, sequence_mode = _context(a)
    sharding = ShardConfig(sequence_parallelism_mode=sequence_mode, **{k: a[k] for k in (
        "enable_tensor_parallelism", "parallel_output", "make_vocab_size_divisible_by", "enable_flash_attention",
        "enable_fused_normalization", "enable_jit_fused", "enable_sequence_overlap", "enable_all_optimization")})
    scaler = GradScalerConfig(**{k: a[k] for k in (
        "initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis", "max_scale",
        "max_skips_at_min_scale")})
    zero = ZeroConfig(a["zero_stage"], a["overlap_communication"],
                      bucket_elements(a["zero_bucket_size_in_m"], "zero_bucket_size_in_m"),
                      cpu_offload=a["cpu_offload"], communication_dtype=a["communication_dtype"])
    return HybridParallelConfig(
        tp_size=a["tp_size"], pp_size=a["pp_size"], cp_size=cp_size, cp_mode=cp_mode,
        sequence_parallel=sequence_parallel, sharding=sharding, custom_policy=a["custom_policy"],
        pipeline=PipelineConfig(a["pp_style"], a["num_model_chunks"], a["num_microbatches"], a["microbatch_size"],
                                a["num_layers_per_stage"]),
        precision=PrecisionConfig(a["precision"], a["max_norm"], 2.0, scaler), zero=zero,
        ddp=DDPConfig(a["broadcast_buffers"], a["ddp_bucket_cap_mb"], a["find_unused_parameters"],
                      a["check_reduction"], a["gradient_as_bucket_view"], a["static_graph"]),
        gradient_checkpoint=a["gradient_checkpoint_config"], fp8_communication=a["fp8_communication"],
        check_inputs=a["check_inputs"], loss_normalization=a["loss_normalization"], compile=a["compile"],
        float8=a["use_fp8"], moe_router_bias_update_rate=a["moe_router_bias_update_rate"],
        dp_replicate_size=a["dp_replicate_size"])


class HybridParallelPlugin(CorePlugin):
    """meshboost's HybridParallelPlugin with ColossalAI's keywords, each mapped onto one field of
    `HybridParallelConfig` (`colossalai_config`):

    tp_size, custom_policy, enable_tensor_parallelism, parallel_output, make_vocab_size_divisible_by,
        enable_sequence_parallelism, enable_flash_attention, enable_fused_normalization, enable_jit_fused,
        enable_sequence_overlap, enable_all_optimization, sequence_parallelism_mode: sharding and kernels
        (`meshboost.shardformer.ShardConfig`, docs/optimizations.md), enable_sequence_parallelism with
        'split_gather' (or 'ring') the layout record's tp mode (`config.dims.sequence_parallel`); sp_size with
        enable_sequence_parallelism=True and sequence_parallelism_mode='all_to_all' or 'ring_attn': the
        context axis, meshboost's cp (`HybridParallelConfig(cp_size=...)`, `config.dims.cp`, the plugin's
        `sp_size`; docs/sequence_parallel.md), with sp_size None or 1 a group of one rank (nothing split); with
        'split_gather' or 'ring' (run as split_gather: the same numbers) the sequence is split over tp and an
        sp_size is ignored, said once on rank 0 (it follows tp_size, as in ColossalAI).
    pp_size: the layout record's pipeline degree (`config.dims.pp`); num_microbatches / microbatch_size (one
        required with pp_size > 1), pp_style ("1f1b" | "interleaved"), num_model_chunks, num_layers_per_stage:
        `meshboost.pipeline.PipelineConfig`.
    precision ("fp32" | "fp16" | "bf16"), max_norm (global-norm clipping when > 0), initial_scale,
        min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
        max_skips_at_min_scale (fp16's dynamic loss scale): `meshboost.optim.PrecisionConfig`.
    zero_stage (0, 1, 2, 3), overlap_communication, zero_bucket_size_in_m (millions of elements),
        cpu_offload (stages 1 and 2: fp32 masters and optimizer states in CPU memory), communication_dtype
        (ZeRO's gradient reduce-scatter dtype): `meshboost.optim.ZeroConfig` (stage 3 is torch FSDP2 under
        tp, docs/fsdp.md; pp_size > 1 and cpu_offload are refused with it).
    find_unused_parameters, ddp_bucket_cap_mb, broadcast_buffers, check_reduction, gradient_as_bucket_view,
        static_graph: `DDPConfig` (torch DDP, used when dp > 1 without ZeRO or pipeline).
    gradient_checkpoint_config: `meshboost.shardformer.PipelineGradientCheckpointConfig`.
    moe_router_bias_update_rate (keyword-only, Megatron's name): DeepSeek-V3's bias update, docs/moe.md.
    dp_replicate_size (keyword-only, meshboost's, torchtitan's name): HSDP with zero_stage=3, the dp ranks
        split into this many replica groups, each sharding the model (docs/fsdp.md).
    check_inputs ("always" | "first" | "never"), loss_normalization ("tokens" | "microbatch"),
        fp8_communication (CUDA, tp=pp=1, zero 0): as `HybridParallelConfig`.
    compile (meshboost's, not ColossalAI's): True or a `meshboost.shardformer.compile.CompileConfig`, each
        transformer block compiled by torch.compile after sharding (docs/compile.md).
    enable_metadata_cache, overlap_p2p: accepted, either value: stage traffic always sends its small
        shape header (shapes may change between steps) and always sends asynchronously.
    use_fp8: True or a `meshboost.shardformer.float8.Float8Config`: torchao's float8 linears, under every
        layout but tp_size > 1 with sp_size > 1 (docs/compile.md).
    scheduler_nodes, dp_outside=False, overlap_allgather, inner_ring_size: refused, saying what
        to use (docs/colossalai.md).

    ColossalAI's views are attributes: `pg_mesh` (meshboost.cluster.ProcessGroupMesh, axes dp_axis=0,
    pp_axis=1, tp_axis=2), `stage_manager` (meshboost.cluster.PipelineStageManager; None at pp_size 1), also
    read as `shard_config.pipeline_stage_manager`.
    """

    def __init__(self, tp_size: int, pp_size: int = 1, precision: str = "fp32", zero_stage: int = 0,
                 parallel_output: bool = True, make_vocab_size_divisible_by: int = 64,
                 custom_policy: Policy | None = None, enable_tensor_parallelism: bool = True,
                 enable_sequence_parallelism: bool = False, max_norm: float = 0.0,
                 num_microbatches: int | None = None, microbatch_size: int | None = None,
                 pp_style: str = "1f1b", num_model_chunks: int = 1, num_layers_per_stage: list[int] | None = None,
                 find_unused_parameters: bool = False, ddp_bucket_cap_mb: int = DDP_BUCKET_CAP_MB,
                 broadcast_buffers: bool = False,
                 initial_scale: float = 2**16, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32, max_skips_at_min_scale: int = 50, overlap_communication: bool = True,
                 zero_bucket_size_in_m: int = 12, check_inputs: str = "always", loss_normalization: str = "tokens",
                 enable_flash_attention: bool = False, enable_fused_normalization: bool = False,
                 enable_jit_fused: bool = False, enable_sequence_overlap: bool = False,
                 enable_all_optimization: bool = False, sequence_parallelism_mode: str | None = None,
                 sp_size: int | None = None,
                 gradient_checkpoint_config: PipelineGradientCheckpointConfig | None = None,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 cpu_offload: bool = False, communication_dtype: torch.dtype | None = None, scheduler_nodes=None,
                 enable_metadata_cache: bool = True, dp_outside: bool = True, overlap_p2p: bool = True,
                 overlap_allgather: bool = False, fp8_communication: bool = False, use_fp8: bool = False,
                 inner_ring_size: int | None = None, compile=None, *, moe_router_bias_update_rate: float = 0.0,
                 dp_replicate_size: int = 1):
        keywords = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        # The refusals and the configs' checks below raise per rank: the arguments are agreed first.
        agree_settings(keywords, "HybridParallelPlugin arguments")
        super().__init__(colossalai_config(keywords))
        self._colossalai_views()

    @property
    def sp_size(self) -> int:
        """ColossalAI's name for the context axis' size: meshboost's cp (`mesh.cp_size`)."""
        return self.mesh.cp_size

    def _colossalai_views(self) -> None:
        """ColossalAI's views of the mesh: axis numbers, pg_mesh, and the stage manager (None without pp)."""
        self.dp_axis, self.pp_axis, self.tp_axis = 0, 1, 2
        self.pg_mesh = ProcessGroupMesh(mesh=self.mesh)
        pc = self.config.pipeline
        self.stage_manager = PipelineStageManager(
            self.pg_mesh, self.pp_axis, enable_interleave=pc.pp_style == "interleaved",
            num_model_chunks=pc.num_model_chunks, num_layers_per_stage=pc.num_layers_per_stage) \
            if self.pp_size > 1 else None
        # ColossalAI's tests read the stage manager through the shard config too (None at pp_size 1)
        self.shard_config = dataclasses.replace(self.shard_config, pipeline_stage_manager=self.stage_manager)
