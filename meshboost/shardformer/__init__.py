"""Tensor-parallel sharding of unmodified HuggingFace models (layers, style registry, policies,
sharder)."""

from meshboost.shardformer.policies import Policy, get_policy, pipeline_layout
from meshboost.shardformer.offload import OffloadConfig, install_offload
from meshboost.shardformer.selective import CHECKPOINTING, enable_checkpointing, selective_policy
from meshboost.shardformer.shard_config import PipelineGradientCheckpointConfig, ShardConfig
from meshboost.shardformer.sharder import ShardFormer, tied_parameters, uses_causal_lm_loss
from meshboost.shardformer.styles import register_attribute_rule, register_style

__all__ = ["ShardConfig", "PipelineGradientCheckpointConfig", "ShardFormer", "Policy", "get_policy", "pipeline_layout",
           "tied_parameters", "register_style", "register_attribute_rule", "uses_causal_lm_loss",
           "CHECKPOINTING", "enable_checkpointing", "selective_policy",
           "OffloadConfig", "install_offload"]
