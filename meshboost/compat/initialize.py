"""ColossalAI's module `initialize`: `launch` and `launch_from_torch`, the same objects as `meshboost.launch`
and `meshboost.launch_from_torch` (ColossalChat's distributed consumers write `from colossalai.initialize
import launch`). Owns nothing: meshboost's launch module starts the process group. ColossalAI's
`launch_from_slurm` / `launch_from_openmpi` are not provided (start the processes with torchrun)."""

from meshboost.distributed.launch import launch, launch_from_torch

__all__ = ["launch", "launch_from_torch"]
