"""Optimizer wrappers, composed as thin layers: the user's optimizer -> MixedPrecisionOptimizer
(fp32 masters, loss scaling, overflow skip, clipping) -> ZeroOptimizer (masters and states
partitioned over dp). The global gradient norm is written once, in grad_norm.py. Memory
accounting: `meshboost.optim.memory` (not imported here so `python -m` runs it cleanly)."""

from meshboost.optim.grad_norm import clip_coefficient, counted_here, global_grad_norm
from meshboost.optim.grad_scaler import DynamicGradScaler, GradScalerConfig
from meshboost.optim.mixed_precision import PRECISION_DTYPES, MixedPrecisionOptimizer
from meshboost.optim.zero import ZeroOptimizer

__all__ = ["DynamicGradScaler", "GradScalerConfig", "MixedPrecisionOptimizer", "ZeroOptimizer", "PRECISION_DTYPES",
           "global_grad_norm", "counted_here", "clip_coefficient"]
