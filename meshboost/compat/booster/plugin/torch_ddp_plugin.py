"""ColossalAI's path `booster.plugin.torch_ddp_plugin`: `TorchDDPPlugin` is meshboost.plugins'
class, served by this package's `__getattr__`."""

from meshboost.booster.plugin import TorchDDPPlugin

__all__ = ["TorchDDPPlugin"]
