"""meshboost: hybrid data x pipeline x tensor parallel training for unmodified HuggingFace models."""

from meshboost.booster import Booster
from meshboost.distributed import ParallelMesh, get_current_device, launch, launch_from_torch, set_seed

__version__ = "0.1.0"
__all__ = ["Booster", "ParallelMesh", "launch", "launch_from_torch", "get_current_device", "set_seed"]
