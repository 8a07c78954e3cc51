"""Parallel strategies a Booster can use, and the configs HybridParallelPlugin takes.

`HybridParallelPlugin(HybridParallelConfig(tp_size=2, pipeline=PipelineConfig(...), precision=
PrecisionConfig(...), zero=ZeroConfig(...), sharding=ShardConfig(...)))`, or its shortcuts
`HybridParallelPlugin(tp_size=2, zero_stage=1, precision="fp16")`; ColossalAI's flat keywords are
`meshboost.booster.plugin.HybridParallelPlugin`'s (the compat package). The other core plugins take typed
configs too (`LowLevelZeroPlugin(LowLevelZeroConfig(...))`, `FSDPPlugin(FSDPConfig(...))`); ColossalAI's
LowLevelZeroPlugin, GeminiPlugin and TorchFSDPPlugin keyword signatures are compat's."""

from meshboost.optim import GradScalerConfig, PrecisionConfig, ZeroConfig
from meshboost.pipeline import PipelineConfig
from meshboost.plugins.config import DDPConfig, HybridParallelConfig
from meshboost.plugins.fsdp import FSDPPlugin
from meshboost.plugins.hybrid_parallel import HybridParallelPlugin
from meshboost.plugins.low_level_zero import LowLevelZeroConfig, LowLevelZeroPlugin
from meshboost.plugins.torch_ddp import TorchDDPPlugin
from meshboost.shardformer import PipelineGradientCheckpointConfig, ShardConfig

__all__ = ["HybridParallelPlugin", "LowLevelZeroPlugin", "TorchDDPPlugin", "FSDPPlugin", "LowLevelZeroConfig",
           "HybridParallelConfig", "DDPConfig", "PipelineConfig", "PrecisionConfig", "GradScalerConfig", "ZeroConfig",
           "ShardConfig", "PipelineGradientCheckpointConfig"]
