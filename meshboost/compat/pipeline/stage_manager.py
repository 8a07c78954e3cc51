"""ColossalAI's path `pipeline.stage_manager.PipelineStageManager`: meshboost's stage questions over a
mesh's pipeline axis, `meshboost.cluster.PipelineStageManager` (the same class, `is`)."""

from meshboost.cluster import PipelineStageManager

__all__ = ["PipelineStageManager"]
