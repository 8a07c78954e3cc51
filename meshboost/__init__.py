"""meshboost: hybrid data x pipeline x tensor parallel training for unmodified HuggingFace models.

This package stands above every floor (docs/design.md): it re-exports the public names and installs
the finder that serves ColossalAI's import paths from `meshboost.compat` (`meshboost.booster.plugin`,
`meshboost.accelerator`, `meshboost.logging`...), before anything else of meshboost is imported."""

from meshboost.compat import paths as _colossalai_paths

_colossalai_paths.install()

from meshboost import accelerator  # noqa: E402  (ColossalAI's `colossalai.accelerator`, served by compat)
from meshboost.booster import Booster  # noqa: E402
from meshboost.distributed import (  # noqa: E402
    ParallelMesh, get_current_device, launch, launch_from_torch, set_seed)

__version__ = "0.1.0"
__all__ = ["Booster", "ParallelMesh", "launch", "launch_from_torch", "get_current_device", "set_seed", "accelerator"]
