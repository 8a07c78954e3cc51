"""Pipeline parallelism: stages cut from an unmodified HF model, 1F1B and interleaved schedules.

See docs/pipeline.md. The plugin wires these together: `PipelineConfig` (checks),
`build_stages` (after tensor-parallel sharding), `StageComm` (p2p over the pp group),
`PipelineSchedule` (one step: micro-batches, loss, gradient reductions).
"""

from meshboost.pipeline.config import PipelineConfig
from meshboost.pipeline.grads import tied_stage_group
from meshboost.pipeline.layout import LAYOUTS, StageLayout, get_layout, split_layers
from meshboost.pipeline.p2p import StageComm
from meshboost.pipeline.schedule import PipelineSchedule, schedule_order, split_microbatches
from meshboost.pipeline.stage import PipelineStages, build_stages, prune_optimizer

__all__ = ["PipelineConfig", "StageLayout", "LAYOUTS", "get_layout", "split_layers", "build_stages",
           "PipelineStages", "prune_optimizer", "StageComm", "PipelineSchedule", "schedule_order",
           "split_microbatches", "tied_stage_group"]
