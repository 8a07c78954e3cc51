"""Parallel strategies a Booster can use."""

from meshboost.plugins.hybrid_parallel import HybridParallelPlugin
from meshboost.plugins.torch_ddp import TorchDDPPlugin

__all__ = ["HybridParallelPlugin", "TorchDDPPlugin"]
