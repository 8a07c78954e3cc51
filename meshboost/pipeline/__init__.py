"""Pipeline parallelism: stages cut from an unmodified HF model, 1F1B and interleaved schedules.

See docs/pipeline.md. The plugin wires these together: `PipelineConfig` (checks),
`build_stages` (after tensor-parallel sharding), `PipelineSchedule` (one step: micro-batches,
loss, gradient reductions) over `meshboost.distributed.p2p.StageComm`.
"""

from meshboost.pipeline.config import PipelineConfig
from meshboost.pipeline.layout import StageLayout, get_layout, split_layers, stage_split
from meshboost.pipeline.schedule import PipelineSchedule, schedule_order, split_microbatches
from meshboost.pipeline.cut import build_stages, prune_optimizer
from meshboost.pipeline.stage import PipelineStages

__all__ = ["PipelineConfig", "StageLayout", "get_layout", "split_layers", "stage_split", "build_stages", "PipelineStages",
           "prune_optimizer", "PipelineSchedule", "schedule_order", "split_microbatches"]
