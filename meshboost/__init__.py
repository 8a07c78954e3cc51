"""meshboost: hybrid data x pipeline x tensor parallel training for unmodified HuggingFace models."""

from meshboost import accelerator
from meshboost.booster import Booster
from meshboost.booster import plugin as _colossalai_plugin_paths
from meshboost.distributed import ParallelMesh, get_current_device, launch, launch_from_torch, set_seed

__version__ = "0.1.0"
__all__ = ["Booster", "ParallelMesh", "launch", "launch_from_torch", "get_current_device", "set_seed", "accelerator"]


def _concrete_plugin(name: str):
    """`meshboost.booster.plugin.<name>` for ColossalAI's plugin names: the class from
    meshboost.plugins. The booster package (floor 2) cannot import the plugins (floor 3); this
    package stands above every floor, so it answers for it, importing the plugins on first use."""
    hints = _colossalai_plugin_paths.CONCRETE_PLUGINS
    if name not in hints:
        raise AttributeError(f"module 'meshboost.booster.plugin' has no attribute {name!r}")
    import meshboost.plugins

    found = getattr(meshboost.plugins, name, None)
    if found is None:
        # ImportError, not AttributeError: `from meshboost.booster.plugin import X` then shows this message.
        instead = f"; {hints[name]}" if hints[name] else ""
        raise ImportError(f"{name} is not available in this meshboost (meshboost.plugins does not export it)"
                          f"{instead}. See docs/colossalai.md")
    return found


_colossalai_plugin_paths.__getattr__ = _concrete_plugin
