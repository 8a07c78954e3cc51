"""ColossalAI's path `booster.plugin.gemini_plugin`: `GeminiPlugin` is meshboost.plugins'
class, served by this package (its docstring says how: the top level provides the floor-3 plugins)."""

from meshboost.booster.plugin import GeminiPlugin

__all__ = ["GeminiPlugin"]
