"""LowLevelZeroPlugin: data parallelism with ZeRO stage 1 or 2 and no model parallelism.

Owns: the wiring only (a dp-only mesh, device placement, the working-dtype cast of weights and
floating-point inputs, the ZeroOptimizer around the user's optimizer), and the answer to every
keyword ColossalAI's LowLevelZeroPlugin takes: honoured, or refused before any collective with the
meshboost way to get the same. The optimizer is the very ZeroOptimizer that
HybridParallelPlugin(zero_stage=...) uses; nothing here reduces, scales, clips or offloads by itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh
from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.inputs import cast_floating
from meshboost.optim import GradScalerConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer, bucket_elements


class LowLevelZeroModel(ModelWrapper):
    """The boosted model: the user's model in the working dtype (ZeRO reduces its gradients).
    input_dtype: floating-point inputs are cast to it (None: left as they are)."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, input_dtype: torch.dtype | None = None):
        super().__init__(module)
        self.mesh = mesh
        self.input_dtype = input_dtype

    def forward(self, *args, **kwargs):
        return self.module(*cast_floating(args, self.input_dtype), **cast_floating(kwargs, self.input_dtype))


def _refuse_unsupported(overlap_allgather, fp8_communication, use_fp8, extra_dp_size) -> None:
    """ColossalAI keywords meshboost does not implement: refused (pure, the same on every rank) with the
    meshboost way to get what they are for."""
    if overlap_allgather:
        raise NotImplementedError(
            "overlap_allgather=True is not supported: meshboost all-gathers the updated shards inside "
            "optimizer.step() (one all-gather per bucket over dp), not lazily during the next forward. Drop the "
            "argument (training is the same); overlap_communication=True overlaps the gradient reduce-scatter "
            "with backward")
    if use_fp8:
        raise NotImplementedError("use_fp8=True (fp8 matmuls) is not supported; train with precision='bf16' or "
                                  "'fp16'")
    if fp8_communication:
        raise NotImplementedError("fp8_communication=True is not supported; communication_dtype=torch.bfloat16 "
                                  "(or torch.float16) reduce-scatters the gradients in 16 bits")
    if not isinstance(extra_dp_size, int) or isinstance(extra_dp_size, bool) or extra_dp_size < 1:
        raise ValueError(f"extra_dp_size={extra_dp_size!r} must be a positive integer (1: partition over every rank)")
    if extra_dp_size > 1:
        raise NotImplementedError(
            f"extra_dp_size={extra_dp_size} (ZeRO partitioned within groups of world/extra_dp_size ranks and "
            "replicated across them) is not supported: meshboost's LowLevelZeroPlugin partitions masters and "
            "optimizer states over every rank (1/world of them per rank). Use extra_dp_size=1")


class LowLevelZeroPlugin(Plugin):
    """ZeRO data parallelism over every rank. The keywords are ColossalAI's, in its order:

    stage: 1 (optimizer states and fp32 masters partitioned) or 2 (gradients too).
    precision: "fp16" (loss-scaled) | "bf16" | "fp32". initial_scale ... max_scale (and the keyword-only
        max_skips_at_min_scale): the fp16 loss scaler. max_norm / norm_type: global-norm clipping when
        max_norm > 0 (norm_type 2.0 or inf). (`meshboost.optim.PrecisionConfig`)
    reduce_bucket_size_in_m: bucket size in millions of elements; communication_dtype: dtype of the
        gradient reduce-scatter (None: the working dtype); overlap_communication: reduce-scatter buckets
        from gradient hooks during backward; cpu_offload: fp32 master shards and optimizer states in CPU
        memory, the inner step on the CPU (gradient shard down, updated shard up each step);
        master_weights=False: no fp32 masters, the inner optimizer steps working-dtype shards.
        (`meshboost.optim.ZeroConfig`, docs/precision_and_zero.md)
    verbose: rank 0 logs skipped fp16 steps (logger "meshboost.optim", INFO).
    cast_inputs: cast floating-point inputs to the working dtype (fp16/bf16) on every call.
    overlap_allgather, fp8_communication, use_fp8, extra_dp_size > 1: refused with the alternative
        (`_refuse_unsupported`).
    """

    def __init__(self, stage: int = 1, precision: str = "fp16", initial_scale: float = 2**16,
                 min_scale: float = 1, growth_factor: float = 2, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, max_scale: float = 2**32,
                 max_norm: float = 0.0, norm_type: float = 2.0, reduce_bucket_size_in_m: int = 12,
                 communication_dtype: torch.dtype | None = None, overlap_communication: bool = True,
                 overlap_allgather: bool = False, cpu_offload: bool = False, master_weights: bool = True,
                 verbose: bool = False, cast_inputs: bool = True, fp8_communication: bool = False,
                 use_fp8: bool = False, extra_dp_size: int = 1, *, max_skips_at_min_scale: int = 50):
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings({k: v for k, v in locals().items() if k != "self"}, "LowLevelZeroPlugin arguments")
        # -- pure checks first: every rank raises the same error before any collective ----------
        _refuse_unsupported(overlap_allgather, fp8_communication, use_fp8, extra_dp_size)
        self.precision_config = PrecisionConfig(precision, max_norm, norm_type, GradScalerConfig(
            initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
            max_skips_at_min_scale))
        self.zero_config = ZeroConfig(stage, overlap_communication, bucket_elements(reduce_bucket_size_in_m,
                                                                                    "reduce_bucket_size_in_m"),
                                      cpu_offload, communication_dtype, master_weights)
        if not self.zero_config.partitioned_by_optimizer:      # a valid stage (the config says), not this plugin's
            raise ValueError(f"stage={stage!r}; LowLevelZeroPlugin supports ZeRO stage 1 or 2 "
                             "(use TorchDDPPlugin for plain data parallelism, HybridParallelPlugin(zero_stage=3) "
                             "for ZeRO-3)")
        self.verbose, self.cast_inputs = bool(verbose), bool(cast_inputs)
        self.mesh = ParallelMesh(tp_size=1, pp_size=1)                  # collective: after the checks

    @property
    def precision(self) -> str:
        return self.precision_config.precision

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        # A model built under torch.device("meta") stays there until booster.load_model materialises it
        # (the masters are filled then: ZeroOptimizer.sync_masters_from_model).
        if not any(p.is_meta for p in model.parameters()):
            model = model.to(self.mesh.device)     # in place: the optimizer's parameters stay the same objects
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = ZeroOptimizer(optimizer, self.mesh, self.precision_config, self.zero_config,
                                      verbose=self.verbose)
        model = model.to(self.precision_config.dtype)   # after the masters copied the fp32 weights
        input_dtype = self.precision_config.dtype if self.cast_inputs else None
        return LowLevelZeroModel(model, self.mesh, input_dtype), optimizer, criterion, dataloader, lr_scheduler

    def lora_refusal(self) -> None:
        return None                       # ZeRO partitions the trainable adapters; the frozen base is left alone

    def no_sync(self, model, optimizer=None):
        """Stage 1: gradients stay local until step. Stage 2: an error (ZeroOptimizer.no_sync says why)."""
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError("no_sync needs the boosted optimizer: booster.no_sync(model, optimizer)")
        return optimizer.no_sync()
