"""ColossalAI's Adam optimizers (`nn.optimizer`) as torch's own Adam: see adam.py."""

from meshboost.nn.optimizer.adam import CPUAdam, FusedAdam, HybridAdam

__all__ = ["HybridAdam", "FusedAdam", "CPUAdam"]
