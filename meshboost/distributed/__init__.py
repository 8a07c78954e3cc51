"""The ground floor every other package stands on: process-group launch, the (dp, pp, tp) mesh,
the collectives (`comm`) and pipeline point-to-point traffic (`p2p`), the records a parameter
carries (`param_info`), and communication accounting (`profiling`). Nothing here imports from
another meshboost package."""

from meshboost.distributed.launch import default_backend, get_current_device, launch, launch_from_torch, set_seed
from meshboost.distributed.dims import ParallelDims, check_mesh_shape
from meshboost.distributed.mesh import ParallelMesh
from meshboost.distributed.profiling import comm_counter, dispatched_comm_counter

__all__ = ["ParallelMesh", "ParallelDims", "check_mesh_shape", "launch", "launch_from_torch", "get_current_device", "set_seed",
           "default_backend", "comm_counter", "dispatched_comm_counter"]
