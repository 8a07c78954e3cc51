"""ColossalAI's path `booster.plugin.torch_fsdp_plugin`: `TorchFSDPPlugin` is meshboost.plugins'
class, served by this package's `__getattr__`."""

from meshboost.booster.plugin import TorchFSDPPlugin

__all__ = ["TorchFSDPPlugin"]
