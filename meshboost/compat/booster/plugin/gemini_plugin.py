"""ColossalAI's path `booster.plugin.gemini_plugin`: `GeminiPlugin` is meshboost.plugins'
class, served by this package's `__getattr__`."""

from meshboost.booster.plugin import GeminiPlugin

__all__ = ["GeminiPlugin"]
