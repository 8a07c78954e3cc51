"""ColossalAI's `booster.plugin.dp_plugin_base.DPPluginBase` path. In ColossalAI it is the base of
the plugins whose `prepare_dataloader` samples over data-parallel ranks; every meshboost plugin
does that (over its mesh's dp axis), so it is the Plugin base itself."""

from meshboost.booster.plugin.plugin_base import Plugin

DPPluginBase = Plugin

__all__ = ["DPPluginBase"]
