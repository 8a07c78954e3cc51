"""Parallel strategies a Booster can use."""

from meshboost.plugins.fsdp import GeminiPlugin, TorchFSDPPlugin
from meshboost.plugins.hybrid_parallel import HybridParallelPlugin
from meshboost.plugins.low_level_zero import LowLevelZeroPlugin
from meshboost.plugins.torch_ddp import TorchDDPPlugin

__all__ = ["HybridParallelPlugin", "LowLevelZeroPlugin", "TorchDDPPlugin", "GeminiPlugin", "TorchFSDPPlugin"]
