"""ColossalAI's path `booster.plugin.low_level_zero_plugin`: `LowLevelZeroPlugin` is meshboost.plugins'
class, served by this package's `__getattr__`."""

from meshboost.booster.plugin import LowLevelZeroPlugin

__all__ = ["LowLevelZeroPlugin"]
