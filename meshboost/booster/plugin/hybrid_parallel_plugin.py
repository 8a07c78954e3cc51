"""ColossalAI's path `booster.plugin.hybrid_parallel_plugin`: `HybridParallelPlugin` is meshboost.plugins'
class, served by this package (its docstring says how: the top level provides the floor-3 plugins)."""

from meshboost.booster.plugin import HybridParallelPlugin

__all__ = ["HybridParallelPlugin"]
