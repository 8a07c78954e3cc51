"""LowLevelZeroPlugin: data parallelism with ZeRO stage 1 or 2 and no model parallelism.

Owns: the wiring only (a dp-only mesh, device placement, the working-dtype cast, the
ZeroOptimizer around the user's optimizer). The optimizer is the very ZeroOptimizer that
HybridParallelPlugin(zero_stage=...) uses; nothing here reduces, scales or clips by itself.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.booster.plugin import Plugin
from meshboost.booster.wrappers import ModelWrapper, OptimizerWrapper
from meshboost.launch import get_current_device
from meshboost.mesh import ParallelMesh
from meshboost.optim import PRECISION_DTYPES, GradScalerConfig, ZeroOptimizer
from meshboost.optim.mixed_precision import check_precision
from meshboost.plugins.dataloader import build_dataloader


class LowLevelZeroModel(ModelWrapper):
    """The boosted model: the user's model in the working dtype (ZeRO reduces its gradients)."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh):
        super().__init__(module)
        self.mesh = mesh


class LowLevelZeroPlugin(Plugin):
    """ZeRO data parallelism over every rank.

    stage: 1 (optimizer states and fp32 masters partitioned) or 2 (gradients too).
    precision: "fp16" (loss-scaled) | "bf16" | "fp32". max_norm: global-norm clipping when > 0.
    initial_scale ... max_scale: the fp16 loss scaler (`meshboost.optim.GradScalerConfig`).
    reduce_bucket_size_in_m: bucket size in millions of elements.
    overlap_communication: reduce-scatter buckets from gradient hooks during backward.
    """

    def __init__(self, stage: int = 1, precision: str = "fp16", initial_scale: float = 2**16,
                 min_scale: float = 1, growth_factor: float = 2, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, max_scale: float = 2**32,
                 max_norm: float = 0.0, norm_type: float = 2.0, reduce_bucket_size_in_m: int = 12,
                 overlap_communication: bool = False):
        # -- pure checks first: every rank raises the same error before any collective ----------
        if stage not in (1, 2):
            raise ValueError(f"stage={stage!r}; LowLevelZeroPlugin supports ZeRO stage 1 or 2 "
                             "(use TorchDDPPlugin for plain data parallelism)")
        check_precision(precision)
        if max_norm < 0:
            raise ValueError(f"max_norm={max_norm!r} must be >= 0 (0 disables clipping)")
        if not (isinstance(reduce_bucket_size_in_m, (int, float)) and reduce_bucket_size_in_m > 0):
            raise ValueError(f"reduce_bucket_size_in_m={reduce_bucket_size_in_m!r} must be a positive number")
        self.scaler_config = GradScalerConfig(initial_scale, min_scale, growth_factor, backoff_factor,
                                              growth_interval, hysteresis, max_scale)
        self.stage, self.precision, self.max_norm, self.norm_type = stage, precision, max_norm, norm_type
        self.reduce_bucket_size = int(reduce_bucket_size_in_m * 1024 * 1024)
        self.overlap_communication = bool(overlap_communication)
        self.mesh = ParallelMesh(tp_size=1, pp_size=1)                  # collective: after the checks

    @property
    def dp_size(self) -> int:
        return self.mesh.dp_size

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        model = model.to(get_current_device())
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = ZeroOptimizer(optimizer, self.mesh, precision=self.precision, stage=self.stage,
                                      max_norm=self.max_norm, norm_type=self.norm_type,
                                      scaler_config=self.scaler_config,
                                      overlap_communication=self.overlap_communication,
                                      reduce_bucket_size=self.reduce_bucket_size)
        model = model.to(PRECISION_DTYPES[self.precision])   # after the masters copied the fp32 weights
        return LowLevelZeroModel(model, self.mesh), optimizer, criterion, dataloader, lr_scheduler

    def prepare_dataloader(self, dataset, batch_size, shuffle=False, seed=1024, drop_last=False, pin_memory=False,
                           num_workers=0, **kwargs):
        return build_dataloader(dataset, batch_size, self.mesh.dp_size, self.mesh.dp_rank, shuffle, seed,
                                drop_last, pin_memory, num_workers, **kwargs)

    def no_sync(self, model, optimizer=None):
        """Stage 1: gradients stay local until step. Stage 2: an error (ZeroOptimizer.no_sync says why)."""
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError("no_sync needs the boosted optimizer: booster.no_sync(model, optimizer)")
        return optimizer.no_sync()
