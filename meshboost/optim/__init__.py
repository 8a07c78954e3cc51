"""Optimizer wrappers, composed as thin layers: the user's optimizer -> MixedPrecisionOptimizer
(fp32 masters, loss scaling, overflow skip, clipping) -> ZeroOptimizer (masters and states
partitioned over dp). Every wrapper exports and imports its state per parameter in one format
(state.py). The global gradient norm is written once, in grad_norm.py; memory accounting lives in
memory.py; ZeRO's CPU offload (masters and states in host memory, the copies each step) in offload.py."""

from meshboost.optim.grad_norm import clip_coefficient, counted_here, global_grad_norm
from meshboost.optim.grad_scaler import DynamicGradScaler, GradScalerConfig
from meshboost.optim.mixed_precision import MixedPrecisionOptimizer
from meshboost.optim.precision import PRECISION_DTYPES, PrecisionConfig, precision_of
from meshboost.optim.wrapper import OptimizerWrapper
from meshboost.optim.zero import ZeroOptimizer
from meshboost.optim.zero_config import ZeroConfig, bucket_elements

__all__ = ["OptimizerWrapper", "DynamicGradScaler", "GradScalerConfig", "MixedPrecisionOptimizer", "PrecisionConfig",
           "ZeroOptimizer", "ZeroConfig", "PRECISION_DTYPES", "precision_of", "bucket_elements", "global_grad_norm",
           "counted_here", "clip_coefficient"]
