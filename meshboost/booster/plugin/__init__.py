"""The Plugin interface, and ColossalAI's import paths for the concrete plugins.

`Plugin` (plugin_base.py) is what the Booster dispatches to. ColossalAI scripts also import the
concrete plugins from here (`from colossalai.booster.plugin import HybridParallelPlugin`), but
they live one floor up, in `meshboost.plugins`, which this package must not import (booster is
floor 2, plugins floor 3: docs/design.md). The top-level package, which stands above every floor,
fills the gap: `meshboost/__init__.py` gives this module a `__getattr__` that returns
`meshboost.plugins.<name>` for the names in CONCRETE_PLUGINS on first use, so importing meshboost
does not import the plugins (and transformers) until a script asks for one. The submodules
`hybrid_parallel_plugin`, `low_level_zero_plugin`, `torch_ddp_plugin`, `gemini_plugin` and
`torch_fsdp_plugin` are ColossalAI's paths to the same classes. See docs/colossalai.md.
"""

from meshboost.booster.plugin.dp_plugin_base import DPPluginBase
from meshboost.booster.plugin.plugin_base import Plugin

# ColossalAI's plugin names served from meshboost.plugins, each with what to use should this meshboost's
# plugins not export it (the ImportError says so).
CONCRETE_PLUGINS = {
    "HybridParallelPlugin": "",
    "LowLevelZeroPlugin": "",
    "TorchDDPPlugin": "",
    "GeminiPlugin": "use LowLevelZeroPlugin(stage=1 or 2) or HybridParallelPlugin(zero_stage=...) for ZeRO",
    "TorchFSDPPlugin": "use LowLevelZeroPlugin(stage=2) (ZeRO-2) or HybridParallelPlugin(zero_stage=...)",
}

# The concrete names are not in __all__: they exist only through the `__getattr__` the top level installs.
__all__ = ["Plugin", "DPPluginBase", "CONCRETE_PLUGINS"]
