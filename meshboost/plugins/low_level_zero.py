"""LowLevelZeroPlugin: data parallelism with ZeRO stage 1 or 2 and no model parallelism.

Owns: the wiring only (a dp-only mesh, device placement, the working-dtype cast, the
ZeroOptimizer around the user's optimizer). The optimizer is the very ZeroOptimizer that
HybridParallelPlugin(zero_stage=...) uses; nothing here reduces, scales or clips by itself.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh
from meshboost.distributed.agreement import agree_settings
from meshboost.optim import GradScalerConfig, PrecisionConfig, ZeroConfig, ZeroOptimizer


class LowLevelZeroModel(ModelWrapper):
    """The boosted model: the user's model in the working dtype (ZeRO reduces its gradients)."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh):
        super().__init__(module)
        self.mesh = mesh


class LowLevelZeroPlugin(Plugin):
    """ZeRO data parallelism over every rank.

    stage: 1 (optimizer states and fp32 masters partitioned) or 2 (gradients too).
    precision: "fp16" (loss-scaled) | "bf16" | "fp32". max_norm / norm_type: global-norm clipping when
    max_norm > 0. initial_scale ... max_skips_at_min_scale: the fp16 loss scaler.
    (`meshboost.optim.PrecisionConfig`)
    reduce_bucket_size_in_m: bucket size in millions of elements; overlap_communication:
    reduce-scatter buckets from gradient hooks during backward. (`meshboost.optim.ZeroConfig`)
    """

    def __init__(self, stage: int = 1, precision: str = "fp16", initial_scale: float = 2**16,
                 min_scale: float = 1, growth_factor: float = 2, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, max_scale: float = 2**32,
                 max_skips_at_min_scale: int = 50,
                 max_norm: float = 0.0, norm_type: float = 2.0, reduce_bucket_size_in_m: int = 12,
                 overlap_communication: bool = False):
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings({k: v for k, v in locals().items() if k != "self"}, "LowLevelZeroPlugin arguments")
        # -- pure checks first: every rank raises the same error before any collective ----------
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r}; LowLevelZeroPlugin supports ZeRO stage 1 or 2 "
                             "(use TorchDDPPlugin for plain data parallelism)")
        if not (isinstance(reduce_bucket_size_in_m, (int, float)) and reduce_bucket_size_in_m > 0):
            raise ValueError(f"reduce_bucket_size_in_m={reduce_bucket_size_in_m!r} must be a positive number")
        self.precision_config = PrecisionConfig(precision, max_norm, norm_type, GradScalerConfig(
            initial_scale, min_scale, growth_factor, backoff_factor, growth_interval, hysteresis, max_scale,
                max_skips_at_min_scale))
        self.zero_config = ZeroConfig(stage, overlap_communication, int(reduce_bucket_size_in_m * 1024 * 1024))
        self.mesh = ParallelMesh(tp_size=1, pp_size=1)                  # collective: after the checks

    @property
    def precision(self) -> str:
        return self.precision_config.precision

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        model = model.to(self.mesh.device)
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            pc, zc = self.precision_config, self.zero_config
            optimizer = ZeroOptimizer(optimizer, self.mesh, precision=pc.precision, stage=zc.stage,
                                      max_norm=pc.max_norm, norm_type=pc.norm_type, scaler_config=pc.scaler,
                                      overlap_communication=zc.overlap_communication,
                                      reduce_bucket_size=zc.reduce_bucket_size)
        model = model.to(self.precision_config.dtype)   # after the masters copied the fp32 weights
        return LowLevelZeroModel(model, self.mesh), optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None):
        """Stage 1: gradients stay local until step. Stage 2: an error (ZeroOptimizer.no_sync says why)."""
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError("no_sync needs the boosted optimizer: booster.no_sync(model, optimizer)")
        return optimizer.no_sync()
