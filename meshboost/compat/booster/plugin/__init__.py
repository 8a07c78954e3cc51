"""ColossalAI's `booster.plugin` package: the Plugin base and the concrete plugins.

`Plugin` and `DPPluginBase` are the core's base (`meshboost.booster.plugin_base`). The concrete plugins
(`from colossalai.booster.plugin import LowLevelZeroPlugin`) are looked up on first use by this module's
own `__getattr__` (PEP 562): importing meshboost does not import the plugins (and transformers) until a
script asks for one. Each but TorchDDPPlugin is a subclass of a core plugin adding only ColossalAI's
keyword constructor, mapped onto the core's typed config: `HybridParallelPlugin` (`hybrid_parallel_plugin`,
its 51 flat keywords onto `HybridParallelConfig`), `MoeHybridParallelPlugin` (ColossalAI's MoE keywords,
ep_size included, onto the same config), `LowLevelZeroPlugin` (onto `LowLevelZeroConfig`), `GeminiPlugin`
and `TorchFSDPPlugin` (onto the FSDP2 engine's `FSDPConfig`, for `meshboost.plugins.FSDPPlugin`). The submodules `hybrid_parallel_plugin`,
`moe_hybrid_parallel_plugin`, `low_level_zero_plugin`,
`torch_ddp_plugin`, `gemini_plugin`, `torch_fsdp_plugin`, `plugin_base` and `dp_plugin_base` are
ColossalAI's paths to the same classes. See docs/colossalai.md.
"""

from meshboost.booster.plugin_base import Plugin

DPPluginBase = Plugin

# ColossalAI's plugin names: the module of this package that holds each (ColossalAI's keyword signature
# mapped onto a core plugin's typed config), or "" for a core plugin served as it is.
CONCRETE_PLUGINS = {
    "HybridParallelPlugin": "hybrid_parallel_plugin",
    "MoeHybridParallelPlugin": "moe_hybrid_parallel_plugin",
    "LowLevelZeroPlugin": "low_level_zero_plugin",
    "GeminiPlugin": "gemini_plugin",
    "TorchFSDPPlugin": "torch_fsdp_plugin",
    "TorchDDPPlugin": "",
}

# The concrete names are not in __all__: `from meshboost.booster.plugin import *` must not import the plugins.
__all__ = ["Plugin", "DPPluginBase", "CONCRETE_PLUGINS"]


def __getattr__(name: str):
    """`meshboost.booster.plugin.<name>` for ColossalAI's plugin names: the class of this package's module
    that maps its keywords, or the core's class, read at every access (never bound here)."""
    if name not in CONCRETE_PLUGINS:
        raise AttributeError(f"module 'meshboost.booster.plugin' has no attribute {name!r}")
    import importlib

    if CONCRETE_PLUGINS[name]:                # ColossalAI's keywords: this package's own mapping
        return getattr(importlib.import_module(f"{__name__}.{CONCRETE_PLUGINS[name]}"), name)
    import meshboost.plugins

    found = getattr(meshboost.plugins, name, None)
    if found is None:
        # ImportError, not AttributeError: `from meshboost.booster.plugin import X` then shows this message.
        raise ImportError(f"{name} is not available in this meshboost (meshboost.plugins does not export it). "
                          "See docs/colossalai.md")
    return found
