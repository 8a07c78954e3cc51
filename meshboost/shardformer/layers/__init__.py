"""Tensor-parallel layers built from native modules (see each file's docstring)."""

from meshboost.shardformer.layers.linear import (
    ColumnParallelLinear,
    ColumnSubsetLinear,
    RowParallelLinear,
    is_conv1d,
    shard_parameter_,
)
from meshboost.shardformer.layers.vocab import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    make_causal_lm_loss,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "ColumnSubsetLinear", "RowParallelLinear", "VocabParallelEmbedding", "VocabParallelLMHead",
    "vocab_parallel_cross_entropy", "make_causal_lm_loss", "shard_parameter_", "is_conv1d",
]
