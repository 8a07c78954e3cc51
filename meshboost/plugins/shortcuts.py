"""A core plugin's one typed config from its constructor's arguments: `config` itself, or the config its
few shortcut keywords build (`HybridParallelPlugin(tp_size=2)`, `LowLevelZeroPlugin(stage=2)`,
`FSDPPlugin(precision="bf16")`). Any other keyword is refused naming the ColossalAI path that takes it,
a config of the wrong type or shortcuts beside a config naming the fix. Pure: the same error on every rank,
before any collective.
"""

from __future__ import annotations

from collections.abc import Callable


def config_from(plugin: str, config_type: type, build: Callable, config, shortcuts: dict, unknown: dict,
                colossalai: str, hint: str | None = None):
    """`config`, or `build(**shortcuts given)`; `colossalai` says where ColossalAI's keywords go, `hint` what
    to pass instead of a config of the wrong type (default: the shortcuts)."""
    names = ", ".join(shortcuts)
    if unknown:
        raise TypeError(f"{plugin}() got {', '.join(sorted(unknown))}: meshboost.plugins.{plugin} takes "
                        f"config={config_type.__name__}(...) (or the shortcuts {names}); {colossalai}")
    given = {k: v for k, v in shortcuts.items() if v is not None}
    if config is None:
        return build(**given)
    if not isinstance(config, config_type):
        raise TypeError(f"{plugin}(config={config!r}): pass a {config_type.__module__}.{config_type.__name__}, or "
                        f"{hint or ', '.join(f'{k}=...' for k in shortcuts)}")
    if given:
        raise ValueError(f"{plugin}(config=..., {', '.join(f'{k}={v!r}' for k, v in given.items())}): set these "
                         f"inside the config ({config_type.__name__}(...)), not beside it")
    return config
