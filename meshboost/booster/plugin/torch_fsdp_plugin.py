"""ColossalAI's path `booster.plugin.torch_fsdp_plugin`: `TorchFSDPPlugin` is meshboost.plugins'
class, served by this package (its docstring says how: the top level provides the floor-3 plugins)."""

from meshboost.booster.plugin import TorchFSDPPlugin

__all__ = ["TorchFSDPPlugin"]
