"""ColossalAI's `booster.plugin` package: the Plugin base and the concrete plugins.

`Plugin` and `DPPluginBase` are the core's base (`meshboost.booster.plugin_base`). The concrete plugins
(`from colossalai.booster.plugin import LowLevelZeroPlugin`) are `meshboost.plugins`' classes, looked
up on first use by this module's own `__getattr__` (PEP 562): importing meshboost does not import the
plugins (and transformers) until a script asks for one, and a plugin meshboost.plugins does not export
is an ImportError saying what to use. `HybridParallelPlugin` is `hybrid_parallel_plugin`'s: ColossalAI's
flat keywords mapped onto meshboost's `HybridParallelConfig` (a subclass of meshboost.plugins' class,
adding only that constructor); `MoeHybridParallelPlugin` is `moe_hybrid_parallel_plugin`'s (ColossalAI's
MoE keywords, ep_size included, onto the same config). The submodules `hybrid_parallel_plugin`,
`moe_hybrid_parallel_plugin`, `low_level_zero_plugin`,
`torch_ddp_plugin`, `gemini_plugin`, `torch_fsdp_plugin`, `plugin_base` and `dp_plugin_base` are
ColossalAI's paths to the same classes. See docs/colossalai.md.
"""

from meshboost.booster.plugin_base import Plugin

DPPluginBase = Plugin

# ColossalAI's plugin names served from meshboost.plugins, each with what to use should this meshboost's
# plugins not export it (the ImportError says so).
CONCRETE_PLUGINS = {
    "HybridParallelPlugin": "",
    "MoeHybridParallelPlugin": "",
    "LowLevelZeroPlugin": "",
    "TorchDDPPlugin": "",
    "GeminiPlugin": "use LowLevelZeroPlugin(stage=1 or 2) or HybridParallelPlugin(zero_stage=...) for ZeRO",
    "TorchFSDPPlugin": "use LowLevelZeroPlugin(stage=2) (ZeRO-2) or HybridParallelPlugin(zero_stage=...)",
}

# The concrete names are not in __all__: `from meshboost.booster.plugin import *` must not import the plugins.
__all__ = ["Plugin", "DPPluginBase", "CONCRETE_PLUGINS"]


def __getattr__(name: str):
    """`meshboost.booster.plugin.<name>` for ColossalAI's plugin names: the class from meshboost.plugins,
    read at every access (never bound here), so what meshboost.plugins exports is the one answer."""
    if name not in CONCRETE_PLUGINS:
        raise AttributeError(f"module 'meshboost.booster.plugin' has no attribute {name!r}")
    if name == "HybridParallelPlugin":        # ColossalAI's flat keywords: this package's own mapping
        from meshboost.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin

        return HybridParallelPlugin
    if name == "MoeHybridParallelPlugin":     # ColossalAI's MoE keywords, mapped by its own module
        from meshboost.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin

        return MoeHybridParallelPlugin
    import meshboost.plugins

    found = getattr(meshboost.plugins, name, None)
    if found is None:
        # ImportError, not AttributeError: `from meshboost.booster.plugin import X` then shows this message.
        instead = f"; {CONCRETE_PLUGINS[name]}" if CONCRETE_PLUGINS[name] else ""
        raise ImportError(f"{name} is not available in this meshboost (meshboost.plugins does not export it)"
                          f"{instead}. See docs/colossalai.md")
    return found
