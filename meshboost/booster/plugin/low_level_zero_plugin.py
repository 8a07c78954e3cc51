"""ColossalAI's path `booster.plugin.low_level_zero_plugin`: `LowLevelZeroPlugin` is meshboost.plugins'
class, served by this package (its docstring says how: the top level provides the floor-3 plugins)."""

from meshboost.booster.plugin import LowLevelZeroPlugin

__all__ = ["LowLevelZeroPlugin"]
