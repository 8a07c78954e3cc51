"""Tensor-parallel layers built from native modules (see each file's docstring)."""

from meshboost.shardformer.layers.linear import (
    ColumnParallelConv1D,
    ColumnParallelLinear,
    RowParallelConv1D,
    RowParallelLinear,
    shard_parameter_,
)
from meshboost.shardformer.layers.vocab import (
    VocabParallelEmbedding,
    VocabParallelLMHead,
    make_causal_lm_loss,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "ColumnParallelConv1D", "RowParallelConv1D",
    "VocabParallelEmbedding", "VocabParallelLMHead", "vocab_parallel_cross_entropy",
    "make_causal_lm_loss", "shard_parameter_",
]
