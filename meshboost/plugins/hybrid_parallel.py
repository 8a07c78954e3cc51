"""HybridParallelPlugin: data x pipeline x tensor parallelism, composed from the pieces.

Owns: mapping ColossalAI's flat keyword arguments onto the typed configs (`plugins/config.py`,
checked before any collective), building the mesh, and wiring sharding, pipeline stages, device
placement, the data-parallel reducer and the optimizer wrapper together. Must not contain
parallel algorithms itself: those live in shardformer/, pipeline/, optim/ and distributed/.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.cluster import PipelineStageManager, ProcessGroupMesh
from meshboost.distributed import ParallelMesh, comm, get_current_device
from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.inputs import cast_floating
from meshboost.distributed.p2p import StageComm
from meshboost.fsdp import is_sharded, no_gradient_sync, reshard_all
from meshboost.lazy import lazy_seed, materialize
from meshboost.optim import GradScalerConfig, MixedPrecisionOptimizer, PrecisionConfig, ZeroConfig, ZeroOptimizer
from meshboost.pipeline import PipelineConfig, PipelineSchedule, build_stages, get_layout, prune_optimizer, split_layers
from meshboost.pipeline.checkpointing import checkpoint_plan, install_checkpoint_plan
from meshboost.pipeline.normalization import TOKENS, count_items
from meshboost.plugins.config import DDP, FSDP, PIPELINE, ZERO, DDPConfig, HybridParallelConfig, dp_reducer
from meshboost.plugins.ddp_hooks import fp8_refusal, register_counting_allreduce, register_fp8_allreduce
from meshboost.plugins.hybrid_zero3 import ZERO3, check_zero3_model, shard_zero3
from meshboost.plugins.input_checks import ALWAYS, InputCheck, LabelledItemsGuard, next_pipeline_batch
from meshboost.shardformer import (
    PipelineGradientCheckpointConfig,
    Policy,
    ShardConfig,
    ShardFormer,
    pipeline_layout,
    uses_causal_lm_loss,
)

class HybridParallelModule(ModelWrapper):
    """The boosted model: the sharded HF model, inside torch DDP over the dp group when the plugin
    chose DDP to reduce gradients. check_inputs: agree over tp (and pp) that every rank got the same
    inputs on every call ("always"), the first call ("first") or never (`input_checks.InputCheck`).
    count_items: a causal LM with loss_normalization="tokens" outside a pipeline: count the labelled
    tokens of every dp replica; at dp > 1 its loss is normalised by them (HF's num_items_in_batch),
    and `items_guard` tells the optimizer when a global batch had none."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, shard_config: ShardConfig, check_inputs: str = ALWAYS,
                 count_items: bool = False, input_dtype: torch.dtype = torch.float32):
        super().__init__(module)
        # Floating-point inputs (pixel_values, input_features, inputs_embeds) are cast to the working
        # precision, as the weights are (ColossalAI's HybridParallelModule does the same).
        self.input_dtype = input_dtype
        self.mesh = mesh
        self.shard_config = shard_config
        self.pipeline: PipelineSchedule | None = None
        self.input_check = InputCheck(mesh, check_inputs)
        self.items_guard = LabelledItemsGuard() if count_items else None
        self.fully_sharded = is_sharded(module)       # zero_stage=3: torch FSDP2 over dp

    def check_same_inputs(self, *inputs, immediate: bool = False) -> None:
        """Raise on every rank of the group when the ranks that must share a batch (tp, and pp with
        stages) got different ones (InputCheck: on CUDA judged at the next call unless `immediate`)."""
        self.input_check(*inputs, immediate=immediate)

    def forward(self, *args, **kwargs):
        self.check_same_inputs(args, kwargs)
        args, kwargs = cast_floating(args, self.input_dtype), cast_floating(kwargs, self.input_dtype)
        if self.items_guard is not None and self.training and torch.is_tensor(kwargs.get("labels")):
            items = self._global_items(kwargs["labels"], kwargs.get("num_items_in_batch"))
            self.items_guard.record(items)
            if self.mesh.dp_size > 1:          # the gradient reduction averages over the replicas
                kwargs["num_items_in_batch"] = items / self.mesh.dp_size
        return self.module(*args, **kwargs)

    def _global_items(self, labels: torch.Tensor, given) -> torch.Tensor:
        """The labelled tokens of every replica (this replica's own count, or the `num_items_in_batch`
        the caller passed for an accumulation window): one 8-byte all-reduce over dp, no host sync."""
        local = given if given is not None else count_items(labels, shifted=True)
        total = torch.as_tensor(local, dtype=torch.float32, device=labels.device).reshape(1).clone()
        comm.all_reduce(total, self.mesh.dp_group)
        return total[0]

    def unwrap(self) -> nn.Module:
        inner = super().unwrap()
        return reshard_all(inner) if self.fully_sharded else inner      # zero_stage=3: the DTensor shards

    def no_sync(self):
        if isinstance(self.module, DistributedDataParallel):
            return self.module.no_sync()
        if self.fully_sharded:                   # zero_stage=3: FSDP2 keeps unreduced gradients inside
            return no_gradient_sync(self.module)
        return contextlib.nullcontext()


def _refuse_unsupported(precision, zero_stage, cpu_offload, communication_dtype, scheduler_nodes, dp_outside,
                        overlap_allgather, fp8_communication, use_fp8, inner_ring_size, layout) -> None:
    """ColossalAI keywords meshboost does not implement, or not in this combination: refused (pure, the
    same on every rank) with the meshboost way to get what they are for."""
    if cpu_offload and zero_stage not in (1, 2):
        raise ValueError(f"cpu_offload=True moves ZeRO's fp32 masters and optimizer states to the CPU, but "
                         f"zero_stage={zero_stage!r}; set zero_stage=1 or 2 (ColossalAI ignores it without ZeRO)")
    working = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    if communication_dtype is not None and communication_dtype != working and zero_stage not in (1, 2):
        raise ValueError(f"communication_dtype={communication_dtype} sets the dtype of ZeRO's gradient "
                         f"reduce-scatter, but zero_stage={zero_stage!r} (DDP and the pipeline reduce in the working "
                         f"precision, {precision!r}); set zero_stage=1 or 2, or pass communication_dtype=None")
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
    if fp8_communication:
        refusal = fp8_refusal(get_current_device().type, "HybridParallelPlugin")
        if refusal:
            raise NotImplementedError(refusal)
        if layout != (1, 1, 0):
            raise NotImplementedError(f"fp8_communication=True with (tp_size, pp_size, zero_stage)={layout}: meshboost "
                                      "compresses only DDP's data-parallel gradient all-reduce (tp_size=1, pp_size=1, "
                                      "zero_stage=0); tensor-parallel, pipeline and ZeRO traffic runs in the working "
                                      "precision. Drop the argument, or use that layout")
    if use_fp8:
        raise NotImplementedError("use_fp8=True (fp8 matmuls) is not supported; train with precision='bf16' or 'fp16'")
    if inner_ring_size is not None:
        raise NotImplementedError(f"inner_ring_size={inner_ring_size}: ring attention is not in meshboost; sequence "
                                  "parallelism is 'split_gather' over the tensor-parallel group")


class HybridParallelPlugin(Plugin):
    """Tensor (Megatron 1D), pipeline and data parallelism over a (dp, pp, tp) mesh.

    The flat keyword arguments follow ColossalAI and map onto `self.config` (HybridParallelConfig):
    tp_size, custom_policy, enable_tensor_parallelism, parallel_output, make_vocab_size_divisible_by,
        enable_sequence_parallelism, enable_flash_attention, enable_fused_normalization, enable_jit_fused,
        enable_sequence_overlap, enable_all_optimization, sequence_parallelism_mode: sharding and kernels
        (`meshboost.shardformer.ShardConfig`, docs/optimizations.md); sp_size: None or 1 (sequence
        parallelism runs over the tp group).
    pp_size, num_microbatches / microbatch_size (one required with pp_size > 1), pp_style ("1f1b" |
        "interleaved"), num_model_chunks, num_layers_per_stage: `meshboost.pipeline.PipelineConfig`.
    precision ("fp32" | "fp16" | "bf16"), max_norm (global-norm clipping when > 0), initial_scale,
        min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
        max_skips_at_min_scale (fp16's dynamic loss scale): `meshboost.optim.PrecisionConfig`.
    zero_stage (0, 1, 2, 3), overlap_communication, zero_bucket_size_in_m (millions of elements):
        stages 1 and 2 are `meshboost.optim.ZeroConfig` (fp32 master and state partitions, and
        gradients at 2); 3 shards the tp-sharded model's weights, gradients and AdamW states over dp with
        torch FSDP2 (`plugins/hybrid_zero3.py`, docs/fsdp.md; the bucket settings do not apply; pp_size
        > 1 and cpu_offload are refused with it).
    find_unused_parameters, ddp_bucket_cap_mb, broadcast_buffers, check_reduction, gradient_as_bucket_view,
        static_graph: `DDPConfig` (torch DDP, used when dp > 1 without ZeRO or pipeline).
    gradient_checkpoint_config: `meshboost.shardformer.PipelineGradientCheckpointConfig`: how many layers
        of each stage run under HF activation checkpointing once it is on (docs/optimizations.md).
    check_inputs: "always" (default) | "first" | "never": agree over tp (and pp) that every rank was
        fed bitwise the same batch, on every call or the first (one all-gather of 6 numbers per group;
        on CUDA a call's verdict is read at the next call: no host sync; docs/reliability.md).
    loss_normalization: "tokens" (default): pipeline micro-batches and, for causal LMs, dp replicas
        are weighted by their labelled tokens, so every layout trains the single-process objective;
        "microbatch": the mean of micro-batch means (ColossalAI). See docs/reliability.md.
    enable_metadata_cache, overlap_p2p: accepted, either value: stage traffic always sends its small
        shape header (shapes may change between steps) and always sends asynchronously.
    cpu_offload (with zero_stage 1 or 2: fp32 masters and optimizer states in CPU memory, the inner step
        there), communication_dtype (with ZeRO: the dtype of the gradient reduce-scatter): `ZeroConfig`.
    fp8_communication: on CUDA with tp_size=1, pp_size=1, zero_stage=0, DDP's gradient buckets are
        all-reduced in fp8 with per-rank scales (`meshboost.distributed.fp8`, lossy by design); refused
        otherwise (other traffic stays in the working precision) and on the CPU.
    scheduler_nodes, dp_outside=False, overlap_allgather, use_fp8, inner_ring_size: refused, saying what
        to use (docs/colossalai.md).

    ColossalAI's views are attributes: `pg_mesh` (meshboost.cluster.ProcessGroupMesh, axes dp_axis=0,
    pp_axis=1, tp_axis=2), `stage_manager` (meshboost.cluster.PipelineStageManager; None at pp_size 1),
    `dp_group`, `pp_group`, `tp_group`, and the sizes `dp_size`, `pp_size`, `tp_size`.
    """

    dp_axis, pp_axis, tp_axis = 0, 1, 2       # ColossalAI's axis numbers of pg_mesh (ParallelMesh's order)

    def __init__(self, tp_size: int, pp_size: int = 1, precision: str = "fp32", zero_stage: int = 0,
                 parallel_output: bool = True, make_vocab_size_divisible_by: int = 64,
                 custom_policy: Policy | None = None, enable_tensor_parallelism: bool = True,
                 enable_sequence_parallelism: bool = False, max_norm: float = 0.0,
                 num_microbatches: int | None = None, microbatch_size: int | None = None,
                 pp_style: str = "1f1b", num_model_chunks: int = 1, num_layers_per_stage: list[int] | None = None,
                 find_unused_parameters: bool = False, ddp_bucket_cap_mb: int = 25, broadcast_buffers: bool = False,
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
                 inner_ring_size: int | None = None):
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings({k: v for k, v in locals().items() if k != "self"}, "HybridParallelPlugin arguments")
        # -- pure checks first: every rank raises the same error before any collective ----------
        if sp_size not in (None, 1):
            raise NotImplementedError(f"sp_size={sp_size!r}: meshboost's sequence parallelism ('split_gather') runs "
                                      "over the tensor-parallel group, so it needs no group of its own; pass "
                                      "sp_size=None with enable_sequence_parallelism=True and tp_size > 1")
        _refuse_unsupported(precision, zero_stage, cpu_offload, communication_dtype, scheduler_nodes, dp_outside,
                            overlap_allgather, fp8_communication, use_fp8, inner_ring_size,
                            layout=(tp_size, pp_size, zero_stage))
        self.fp8_communication = bool(fp8_communication)
        if gradient_checkpoint_config is not None and not isinstance(gradient_checkpoint_config,
                                                                     PipelineGradientCheckpointConfig):
            raise TypeError(f"gradient_checkpoint_config={gradient_checkpoint_config!r}: pass a "
                            "meshboost.shardformer.PipelineGradientCheckpointConfig")
        self.gradient_checkpoint_config = gradient_checkpoint_config
        if not (isinstance(zero_bucket_size_in_m, (int, float)) and zero_bucket_size_in_m > 0):
            raise ValueError(f"zero_bucket_size_in_m={zero_bucket_size_in_m!r} must be a positive number")
        self.config = HybridParallelConfig(
            tp_size=tp_size,
            sharding=ShardConfig(enable_tensor_parallelism=enable_tensor_parallelism, parallel_output=parallel_output,
                                 make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                 enable_sequence_parallelism=enable_sequence_parallelism,
                                 sequence_parallelism_mode=sequence_parallelism_mode,
                                 enable_flash_attention=enable_flash_attention,
                                 enable_fused_normalization=enable_fused_normalization,
                                 enable_jit_fused=enable_jit_fused, enable_sequence_overlap=enable_sequence_overlap,
                                 enable_all_optimization=enable_all_optimization),
            custom_policy=custom_policy,
            pipeline=PipelineConfig(pp_size, pp_style, num_model_chunks, num_microbatches, microbatch_size,
                                    num_layers_per_stage),
            precision=PrecisionConfig(precision, max_norm, 2.0, GradScalerConfig(
                initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
                max_skips_at_min_scale)),
            zero=ZeroConfig(0 if zero_stage == ZERO3 else zero_stage, overlap_communication,
                            int(zero_bucket_size_in_m * 1024 * 1024),
                            cpu_offload=cpu_offload, communication_dtype=communication_dtype),
            fully_sharded=zero_stage == ZERO3,
            ddp=DDPConfig(broadcast_buffers, ddp_bucket_cap_mb, find_unused_parameters, check_reduction,
                          gradient_as_bucket_view, static_graph),
            check_inputs=check_inputs, loss_normalization=loss_normalization)
        self.mesh = ParallelMesh(tp_size=tp_size, pp_size=pp_size)       # collective: after the checks
        self.shard_config = dataclasses.replace(self.config.sharding, tensor_parallel_process_group=self.mesh.tp_group)
        self.dp_reducer = dp_reducer(self.mesh.dp_size, pp_size, zero_stage)
        self.pg_mesh = ProcessGroupMesh(mesh=self.mesh)
        self.stage_manager = PipelineStageManager(
            self.pg_mesh, self.pp_axis, enable_interleave=pp_style == "interleaved", num_model_chunks=num_model_chunks,
            num_layers_per_stage=num_layers_per_stage) if pp_size > 1 else None

    # a LazyInitContext model is materialised in configure, after sharding: each rank initialises its part
    materializes_lazy_models = True

    # ColossalAI reads these off the plugin
    @property
    def dp_group(self):
        return self.mesh.dp_group

    @property
    def pp_group(self):
        return self.mesh.pp_group

    @property
    def tp_group(self):
        return self.mesh.tp_group

    @property
    def tp_size(self) -> int:
        return self.mesh.tp_size

    @property
    def pp_size(self) -> int:
        return self.mesh.pp_size

    @property
    def precision(self) -> str:
        return self.config.precision.precision

    @property
    def zero_stage(self) -> int:
        return self.config.zero_stage

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        # A model built under torch.device("meta") stays on meta until booster.load_model materialises
        # it; DDP needs real weights at construction, so that combination is refused (every rank).
        lazy = lazy_seed(model)          # built under LazyInitContext: materialised below, this rank's part only
        original = copy.deepcopy(model) if lazy is not None else None        # on meta: no memory
        on_meta = lazy is None and any(p.is_meta for p in model.parameters())
        if on_meta and self.dp_reducer == DDP:
            raise ValueError(f"a meta-device model cannot be boosted with dp_size={self.mesh.dp_size} and "
                             "zero_stage=0 (torch DDP needs real weights); use zero_stage=1 or 2, or build the "
                             "model with real weights")
        if self.dp_reducer == FSDP:
            check_zero3_model(model, optimizer, on_meta)
        checkpointed = self._checkpointed_layers(model)          # pure: raises on every rank alike
        ShardFormer(self.shard_config).optimize(model, self.config.custom_policy)
        stages = self._build_stages(model, optimizer) if self.pp_size > 1 else None
        if checkpointed is not None:
            install_checkpoint_plan(model, checkpointed(stages))
        if lazy is not None:
            materialize(model, original, self.mesh.device, lazy)
        if not on_meta:
            model = model.to(self.mesh.device)  # in place: the optimizer's parameters stay the same objects
        if self.dp_reducer == FSDP:     # FSDP2 over dp: its fp32 shards are the masters; compute dtype by its policy
            _, optimizer = shard_zero3(model, optimizer, self.mesh, self.config.precision)
        else:
            if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
                optimizer = self._wrap_optimizer(optimizer)  # fp32 masters from the fp32 weights, before the cast
            model = model.to(self.config.precision.dtype)   # working weights (in place, same objects)
        module: nn.Module = model
        if self.dp_reducer == DDP:
            device = self.mesh.device
            module = DistributedDataParallel(model, process_group=self.mesh.dp_group,
                                             device_ids=[device] if device.type == "cuda" else None,
                                             **self.config.ddp.kwargs())
            if self.fp8_communication:
                register_fp8_allreduce(module, self.mesh.dp_group)
            else:
                register_counting_allreduce(module, self.mesh.dp_group)
        count = self.config.loss_normalization == TOKENS and stages is None and uses_causal_lm_loss(model)
        boosted = HybridParallelModule(module, self.mesh, self.shard_config, self.config.check_inputs, count,
                                       input_dtype=self.config.precision.dtype)
        if boosted.items_guard is not None and isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer.check_before_update(boosted.items_guard)     # no labelled token: refuse the update
        if stages is not None:
            boosted.pipeline = self._build_schedule(stages)
        return boosted, optimizer, criterion, dataloader, lr_scheduler

    def _checkpointed_layers(self, model: nn.Module):
        """With gradient_checkpoint_config: check its counts against every stage's layers (all stages,
        on every rank, before any collective) and return what gives (layer, checkpointed) for this
        rank's stages once they are built."""
        config = self.gradient_checkpoint_config
        if config is None:
            return None
        layout = get_layout(model, pipeline_layout(model, self.config.custom_policy))
        base = model.base_model
        lists = [base.get_submodule(segment.layers) for segment in layout.segments]
        pc = self.config.pipeline
        num_stages = pc.pp_size * pc.num_model_chunks
        ranges = split_layers(sum(len(layers) for layers in lists), num_stages, pc.num_layers_per_stage)
        for v, r in enumerate(ranges):
            config.layers_to_checkpoint(v, len(r), num_stages)

        def plan(stages):
            if stages is None:
                return checkpoint_plan([(0, [layer for layers in lists for layer in layers])], 1, config)
            mine = [stages.virtual(c) for c in range(stages.num_chunks)]
            return checkpoint_plan([(v, [stages.kept[i] for i in stages.layer_ranges[v]]) for v in mine],
                                   num_stages, config)
        return plan

    def _wrap_optimizer(self, optimizer) -> MixedPrecisionOptimizer:
        """user optimizer -> MixedPrecisionOptimizer, or ZeroOptimizer when ZeRO reduces over dp."""
        pc = self.config.precision
        common = dict(precision=pc.precision, max_norm=pc.max_norm, norm_type=pc.norm_type, scaler_config=pc.scaler)
        if self.dp_reducer != ZERO:
            return MixedPrecisionOptimizer(optimizer, self.mesh, **common)
        zc = self.config.zero
        return ZeroOptimizer(optimizer, self.mesh, stage=zc.stage, overlap_communication=zc.overlap_communication,
                             reduce_bucket_size=zc.reduce_bucket_size, cpu_offload=zc.cpu_offload,
                             communication_dtype=zc.communication_dtype, **common)

    def lora_refusal(self) -> str | None:
        if self.tp_size > 1 or self.pp_size > 1:          # ColossalAI: tp_size == 1 only
            return (f"LoRA with tp_size={self.tp_size}, pp_size={self.pp_size}: peft's adapter layers are not "
                    "sharded or staged by meshboost's policies; use HybridParallelPlugin(tp_size=1, pp_size=1) "
                    "(ZeRO and precision as you like), LowLevelZeroPlugin or TorchDDPPlugin")
        return None

    # -- pipeline parallelism (meshboost/pipeline) ---------------------------------------------------
    @property
    def supports_pipeline(self) -> bool:
        return self.pp_size > 1

    def _build_stages(self, model: nn.Module, optimizer):
        """Cut the (tp-sharded) model down to this rank's stages; drop the other stages' parameters
        from the user's optimizer before any wrapper builds masters from it."""
        cfg = self.config.pipeline
        stages = build_stages(model, self.mesh.pp_rank, cfg.pp_size, cfg.num_model_chunks, cfg.num_layers_per_stage,
                              layout=pipeline_layout(model, self.config.custom_policy))
        if self.shard_config.enable_sequence_parallelism and self.shard_config.tensor_parallel_size > 1:
            stages.seq_split = self.shard_config.tensor_parallel_size     # boundaries carry 1/tp of the sequence
        prune_optimizer(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer, model)
        return stages

    def _build_schedule(self, stages) -> PipelineSchedule:
        cfg = self.config.pipeline
        # collective: every rank builds the group of each set of pp ranks sharing a weight, in the same order
        tied = [(self.mesh.stage_group(ranks), params) for ranks, params in stages.ties]
        dp_group = self.mesh.dp_group if self.dp_reducer == PIPELINE else None
        return PipelineSchedule(stages, StageComm(self.mesh.pp_group, self.mesh.device), cfg.num_microbatches,
                                cfg.microbatch_size, dp_group=dp_group, tied=tied,
                                loss_normalization=self.config.loss_normalization, count_group=self.mesh.dp_group,
                                count_size=self.mesh.dp_size, shifted_labels=uses_causal_lm_loss(stages.model),
                                input_dtype=self.config.precision.dtype)

    def execute_pipeline(self, data_iter, model, criterion, optimizer=None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict:
        """One pipeline step on `next(data_iter)`: forward (and backward when `optimizer` is given) over its
        micro-batches. Returns {"loss": mean micro-batch loss on every rank, "outputs": last stage only}.
        StopIteration on every rank when every iterator ran out; an error on every rank when only some did
        (`input_checks.next_pipeline_batch`)."""
        pipeline = model.pipeline if isinstance(model, HybridParallelModule) else None
        if pipeline is None:
            raise TypeError("execute_pipeline needs the model returned by booster.boost(...) with pp_size > 1")
        if not hasattr(data_iter, "__next__"):
            raise TypeError(f"execute_pipeline takes an iterator (e.g. iter(dataloader)), got "
                            f"{type(data_iter).__name__}")
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            raise TypeError("execute_pipeline needs the optimizer returned by booster.boost(...) (or None to evaluate)")
        # ZeRO: keep gradients local over all micro-batches and reduce-scatter them once per step, not
        # once per micro-batch (stage 1 at step(); stage 2 when the schedule is done, freeing the full
        # gradients: ZeroOptimizer.accumulate_then_reduce).
        local = optimizer.accumulate_then_reduce() if optimizer is not None and self.dp_reducer == ZERO \
            else contextlib.nullcontext()
        # Every rank has a batch (or none: StopIteration everywhere) and the global batch a labelled
        # token, agreed over the world before anything runs; the step waits for the host here anyway.
        batch, items = next_pipeline_batch(data_iter, self.mesh, pipeline.count_items, training=optimizer is not None)
        model.check_same_inputs(batch, immediate=True)
        with local:
            return pipeline.run(batch, criterion, optimizer, return_loss, return_outputs, items=items)

    def no_sync(self, model, optimizer=None):
        """Whoever reduces the gradients skips it inside the block: DDP's no_sync, FSDP2's (zero_stage=3), or
        the ZeRO optimizer's (stage 1: gradients stay local until step; stage 2: an error, see
        ZeroOptimizer.no_sync)."""
        if not isinstance(model, HybridParallelModule):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        if self.dp_reducer == ZERO:
            if not isinstance(optimizer, ZeroOptimizer):
                raise TypeError(f"no_sync with zero_stage={self.zero_stage} needs the boosted optimizer: "
                                "booster.no_sync(model, optimizer)")
            return optimizer.no_sync()
        return model.no_sync()
