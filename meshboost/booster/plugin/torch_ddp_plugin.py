"""ColossalAI's path `booster.plugin.torch_ddp_plugin`: `TorchDDPPlugin` is meshboost.plugins'
class, served by this package (its docstring says how: the top level provides the floor-3 plugins)."""

from meshboost.booster.plugin import TorchDDPPlugin

__all__ = ["TorchDDPPlugin"]
