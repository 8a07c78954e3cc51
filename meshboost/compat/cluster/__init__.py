"""ColossalAI's `cluster` package over meshboost's process groups: `DistCoordinator` (rank, world
size, printing and waiting on one rank), `ProcessGroupMesh` (a view of a `ParallelMesh` with
ColossalAI's axis-number interface) and `PipelineStageManager` (stage questions along the
pipeline axis; ColossalAI keeps it in `pipeline.stage_manager`). In the compat package (served as
`meshboost.cluster`): ColossalAI's HybridParallelPlugin builds the views; no core module imports
them. Stands on `meshboost.distributed` only. See docs/colossalai.md."""

from meshboost.cluster.dist_coordinator import DistCoordinator
from meshboost.cluster.process_group_mesh import ProcessGroupMesh
from meshboost.cluster.stage_manager import PipelineStageManager

__all__ = ["DistCoordinator", "ProcessGroupMesh", "PipelineStageManager"]
