"""HybridParallelPlugin: data x pipeline x tensor parallelism, composed from the pieces.

Owns: checking the configuration (before any collective), building the mesh, and wiring sharding,
device placement, the data-parallel wrapper and the optimizer wrapper together. Must not contain
parallel algorithms itself: those live in shardformer/, optim/ and pipeline/.
"""

from __future__ import annotations

import contextlib

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshboost.booster.plugin import Plugin
from meshboost.booster.wrappers import ModelWrapper, OptimizerWrapper
from meshboost.launch import get_current_device
from meshboost.mesh import ParallelMesh
from meshboost.optim import PRECISION_DTYPES, GradScalerConfig, MixedPrecisionOptimizer, ZeroOptimizer
from meshboost.pipeline import (PipelineConfig, PipelineSchedule, StageComm, build_stages, prune_optimizer,
                                tied_stage_group)
from meshboost.plugins.dataloader import build_dataloader
from meshboost.plugins.ddp_hooks import register_counting_allreduce
from meshboost.shardformer import Policy, ShardConfig, ShardFormer

PRECISIONS = ("fp32", "fp16", "bf16")


class HybridParallelModule(ModelWrapper):
    """The boosted model: the sharded HF model, inside torch DDP over the dp group when
    dp > 1 and ZeRO is off."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, shard_config: ShardConfig):
        super().__init__(module)
        self.mesh = mesh
        self.shard_config = shard_config

    def no_sync(self):
        if isinstance(self.module, DDP):
            return self.module.no_sync()
        import contextlib
        return contextlib.nullcontext()


class HybridParallelPlugin(Plugin):
    """Tensor (Megatron 1D), pipeline and data parallelism over a (dp, pp, tp) mesh.

    tp_size: tensor-parallel degree (ranks tp-adjacent). pp_size: pipeline stages.
    precision: "fp32" | "fp16" | "bf16". zero_stage: 0, 1 or 2 (partition optimizer state over dp).
    parallel_output: keep LM logits vocab-split in training (loss computed vocab-parallel).
    make_vocab_size_divisible_by: vocab padded to a multiple of this times tp_size.
    custom_policy: a `meshboost.shardformer.Policy` to use instead of the registry's.
    max_norm: clip gradients by their global norm when > 0.
    num_microbatches / microbatch_size (one required with pp_size > 1), pp_style ("1f1b" | "interleaved"),
        num_model_chunks (> 1 with "interleaved"), num_layers_per_stage: see `meshboost.pipeline.PipelineConfig`.
    find_unused_parameters, ddp_bucket_cap_mb, broadcast_buffers: passed to torch DDP (dp > 1).
    initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale:
        the dynamic loss scaler of fp16 (`meshboost.optim.GradScalerConfig`).
    overlap_communication: ZeRO launches bucket reduce-scatters from gradient hooks during backward.
    zero_bucket_size_in_m: ZeRO bucket size in millions of elements.
    """

    def __init__(self, tp_size: int, pp_size: int = 1, precision: str = "fp32", zero_stage: int = 0,
                 parallel_output: bool = True, make_vocab_size_divisible_by: int = 64,
                 custom_policy: Policy | None = None, enable_tensor_parallelism: bool = True,
                 enable_sequence_parallelism: bool = False, max_norm: float = 0.0,
                 num_microbatches: int | None = None, microbatch_size: int | None = None,
                 pp_style: str = "1f1b", num_model_chunks: int = 1, num_layers_per_stage: list[int] | None = None,
                 find_unused_parameters: bool = False, ddp_bucket_cap_mb: int = 25, broadcast_buffers: bool = False,
                 initial_scale: float = 2**16, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32, overlap_communication: bool = False, zero_bucket_size_in_m: int = 12):
        # -- pure checks first: every rank raises the same error before any collective ----------
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}; expected one of {PRECISIONS}")
        if zero_stage not in (0, 1, 2):
            raise ValueError(f"zero_stage={zero_stage!r}; expected 0, 1 or 2")
        if custom_policy is not None and not isinstance(custom_policy, Policy):
            raise TypeError(f"custom_policy must be a meshboost.shardformer.Policy, got {type(custom_policy).__name__}")
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm!r} must be >= 0 (0 disables clipping)")
        self.pipeline_config = PipelineConfig(pp_size, pp_style, num_model_chunks, num_microbatches,   # validates
                                              microbatch_size, num_layers_per_stage, zero_stage)
        self.scaler_config = GradScalerConfig(initial_scale, min_scale, growth_factor, backoff_factor,
                                              growth_interval, hysteresis, max_scale)    # validates
        if not (isinstance(zero_bucket_size_in_m, (int, float)) and zero_bucket_size_in_m > 0):
            raise ValueError(f"zero_bucket_size_in_m={zero_bucket_size_in_m!r} must be a positive number")
        self.overlap_communication = bool(overlap_communication)
        self.reduce_bucket_size = int(zero_bucket_size_in_m * 1024 * 1024)
        self.tp_size, self.pp_size = tp_size, pp_size
        self.precision, self.zero_stage, self.max_norm = precision, zero_stage, max_norm
        self.custom_policy = custom_policy
        self.ddp_kwargs = dict(find_unused_parameters=find_unused_parameters, bucket_cap_mb=ddp_bucket_cap_mb,
                               broadcast_buffers=broadcast_buffers)
        self.mesh = ParallelMesh(tp_size=tp_size, pp_size=pp_size)       # collective: after the checks
        self.shard_config = ShardConfig(
            tensor_parallel_process_group=self.mesh.tp_group, enable_tensor_parallelism=enable_tensor_parallelism,
            parallel_output=parallel_output, make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            enable_sequence_parallelism=enable_sequence_parallelism)

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        # A model built under torch.device("meta") stays on meta until booster.load_model materialises
        # it; DDP needs real weights at construction, so that combination is refused (every rank).
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and self.mesh.dp_size > 1 and self.zero_stage == 0 and self.pp_size == 1:
            raise ValueError(f"a meta-device model cannot be boosted with dp_size={self.mesh.dp_size} and "
                             "zero_stage=0 (torch DDP needs real weights); use zero_stage=1 or 2, or build the "
                             "model with real weights")
        model, _shared = ShardFormer(self.shard_config).optimize(model, self.custom_policy)
        stages = self._build_stages(model, optimizer) if self.pp_size > 1 else None
        device = get_current_device()
        if not on_meta:
            model = model.to(device)       # in place: the optimizer's parameters stay the same objects
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = self._wrap_optimizer(optimizer)     # fp32 masters from the fp32 weights, before the cast
        model = model.to(PRECISION_DTYPES[self.precision])  # working weights (in place, same objects)
        module: nn.Module = model
        if self.mesh.dp_size > 1 and self.zero_stage == 0 and stages is None:   # pp: grads reduced after the schedule
            module = DDP(model, process_group=self.mesh.dp_group,
                         device_ids=[device] if device.type == "cuda" else None, **self.ddp_kwargs)
            register_counting_allreduce(module, self.mesh.dp_group)
        boosted = HybridParallelModule(module, self.mesh, self.shard_config)
        if stages is not None:
            boosted.pipeline = self._build_schedule(stages)
        return boosted, optimizer, criterion, dataloader, lr_scheduler

    # -- pipeline parallelism (meshboost/pipeline) ---------------------------------------------------
    @property
    def supports_pipeline(self) -> bool:
        return self.pp_size > 1

    def _build_stages(self, model: nn.Module, optimizer):
        """Cut the (tp-sharded) model down to this rank's stages; drop the other stages' parameters
        from the user's optimizer before any wrapper builds masters from it."""
        cfg = self.pipeline_config
        stages = build_stages(model, self.mesh.pp_rank, cfg.pp_size, cfg.num_model_chunks, cfg.num_layers_per_stage)
        prune_optimizer(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer, model)
        return stages

    def _build_schedule(self, stages) -> PipelineSchedule:
        cfg = self.pipeline_config
        tied_group = tied_stage_group(self.mesh) if stages.has_tied else None    # collective: every rank
        dp_group = self.mesh.dp_group if self.mesh.dp_size > 1 and self.zero_stage == 0 else None  # ZeRO reduces itself
        return PipelineSchedule(stages, StageComm(self.mesh.pp_group, get_current_device()), cfg.num_microbatches,
                                cfg.microbatch_size, dp_group=dp_group, tied_group=tied_group)

    def execute_pipeline(self, data_iter, model, criterion, optimizer=None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict:
        """One pipeline step on `next(data_iter)`: forward (and backward when `optimizer` is given) over its
        micro-batches. Returns {"loss": mean micro-batch loss on every rank, "outputs": last stage only}."""
        pipeline = getattr(model, "pipeline", None)
        if pipeline is None:
            raise TypeError("execute_pipeline needs the model returned by booster.boost(...) with pp_size > 1")
        if not hasattr(data_iter, "__next__"):
            raise TypeError(f"execute_pipeline takes an iterator (e.g. iter(dataloader)), got {type(data_iter).__name__}")
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            raise TypeError("execute_pipeline needs the optimizer returned by booster.boost(...) (or None to evaluate)")
        # ZeRO-1: keep gradients local over all micro-batches; step() reduce-scatters them once.
        local = optimizer.no_sync() if optimizer is not None and self.zero_stage == 1 else contextlib.nullcontext()
        with local:
            return pipeline.run(next(data_iter), criterion, optimizer, return_loss, return_outputs)

    def prepare_dataloader(self, dataset, batch_size, shuffle=False, seed=1024, drop_last=False, pin_memory=False,
                           num_workers=0, **kwargs):
        return build_dataloader(dataset, batch_size, self.mesh.dp_size, self.mesh.dp_rank, shuffle, seed,
                                drop_last, pin_memory, num_workers, **kwargs)

    def _wrap_optimizer(self, optimizer) -> MixedPrecisionOptimizer:
        """user optimizer -> MixedPrecisionOptimizer (zero_stage 0: dp reduction is DDP's) or
        ZeroOptimizer (zero_stage 1/2: the optimizer reduces over dp itself)."""
        common = dict(precision=self.precision, max_norm=self.max_norm, scaler_config=self.scaler_config)
        if self.zero_stage == 0:
            return MixedPrecisionOptimizer(optimizer, self.mesh, **common)
        return ZeroOptimizer(optimizer, self.mesh, stage=self.zero_stage,
                             overlap_communication=self.overlap_communication,
                             reduce_bucket_size=self.reduce_bucket_size, **common)

    def no_sync(self, model, optimizer=None):
        """zero_stage 0: DDP's no_sync. zero_stage 1: the ZeRO optimizer's (gradients stay local
        until step). zero_stage 2: an error (see ZeroOptimizer.no_sync)."""
        if not isinstance(model, HybridParallelModule):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        if self.zero_stage > 0:
            if not isinstance(optimizer, ZeroOptimizer):
                raise TypeError(f"no_sync with zero_stage={self.zero_stage} needs the boosted optimizer: "
                                "booster.no_sync(model, optimizer)")
            return optimizer.no_sync()
        return model.no_sync()
