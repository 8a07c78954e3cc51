"""Tensor-parallel sharding of unmodified HuggingFace models (layers, policies, sharder)."""

from meshboost.shardformer.policies import Policy, get_policy
from meshboost.shardformer.shard_config import ShardConfig
from meshboost.shardformer.sharder import ShardFormer

__all__ = ["ShardConfig", "ShardFormer", "Policy", "get_policy"]
