"""ColossalAI's path `booster.plugin.plugin_base.Plugin`: the core's Plugin base (`meshboost.booster.plugin_base`)."""

from meshboost.booster.plugin_base import Plugin

__all__ = ["Plugin"]
