"""ColossalAI's `booster.plugin.dp_plugin_base.DPPluginBase` path. In ColossalAI it is the base of
the plugins whose `prepare_dataloader` samples over data-parallel ranks; every meshboost plugin
does that (over its mesh's dp axis), so it is the Plugin base itself. A user's subclass that only
implements `configure` (ColossalAI's tests write such plugins) gets `Plugin.__init__`: a dp-only mesh
over every rank, and ColossalAI's `rank` / `world_size`."""

from meshboost.booster.plugin_base import Plugin

DPPluginBase = Plugin

__all__ = ["DPPluginBase"]
