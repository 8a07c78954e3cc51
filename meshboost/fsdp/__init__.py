"""The FSDP2 engine: ZeRO-3 on torch's `fully_shard`, for any plugin that composes it.

Owns: `FSDPConfig` (config.py: the build, checked when constructed), cutting a model into units and
sharding it over the data-parallel mesh, moving the user's optimizer onto the shards (wrap.py),
`FSDPOptimizer` (optimizer.py: the step and per-parameter state over DTensor shards), and sharding a
tensor-parallel model over dp with its records and gradient hooks carried (tensor_parallel.py), and
when a pipeline stage gathers and reduce-scatters within a step (pipeline.py).
Must not import plugins/ or booster/, know a plugin's keyword arguments, or read a model family's
layout (the caller names the transformer layers): GeminiPlugin, TorchFSDPPlugin and
HybridParallelPlugin(zero_stage=3) in plugins/ map their arguments onto `FSDPConfig` and call it.
"""

from meshboost.fsdp.config import FSDPConfig
from meshboost.fsdp.optimizer import FSDPOptimizer
from meshboost.fsdp.pipeline import StepSharding
from meshboost.fsdp.tensor_parallel import shard_tensor_parallel
from meshboost.fsdp.wrap import (Layers, apply_fsdp, boost_optimizer, carry_state, is_sharded, move_optimizer,
                                 no_gradient_sync, prepare, reshard_all, shard_units)

__all__ = ["FSDPConfig", "FSDPOptimizer", "Layers", "apply_fsdp", "boost_optimizer", "carry_state", "is_sharded",
           "move_optimizer", "no_gradient_sync", "prepare", "reshard_all", "shard_tensor_parallel", "shard_units",
           "StepSharding"]
