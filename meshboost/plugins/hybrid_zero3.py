"""ZeRO-3 under tensor parallelism: HybridParallelPlugin(tp_size=T, zero_stage=3), composed.

Owns: what the plugin accepts for zero_stage=3 (models and optimizers it cannot shard are refused
here; pipeline stages with the other settings, in config.py) and the call into the FSDP2 engine
(`meshboost.fsdp.shard_tensor_parallel`, which shards the tensor-parallel model over dp and carries
its records and gradient hooks) with the model's transformer layers as units. Must not shard,
reduce or move records itself: meshboost.fsdp and meshboost.distributed.param_info do.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.booster import OptimizerWrapper
from meshboost.fsdp import is_sharded, shard_tensor_parallel
from meshboost.optim import PrecisionConfig
from meshboost.plugins.fsdp_wrap import transformer_layers


def check_zero3_model(model: nn.Module, optimizer, on_meta: bool) -> None:
    """Pure checks on what is boosted (every rank raises alike, before any collective). on_meta: the
    model has meta-device parameters and was not built under LazyInitContext (which materialises)."""
    if is_sharded(model):
        raise RuntimeError("HybridParallelPlugin(zero_stage=3): this model is already sharded by FSDP; boost the "
                           "original model once")
    if on_meta:
        raise NotImplementedError("HybridParallelPlugin(zero_stage=3): the model has parameters on the meta device; "
                                  "FSDP2 needs real weights (build it normally, from_pretrained, or under "
                                  "LazyInitContext)")
    if isinstance(optimizer, OptimizerWrapper):
        raise TypeError("HybridParallelPlugin(zero_stage=3): pass the user's torch optimizer to boost(), not a "
                        "boosted one")
    names = {id(p) for p in model.parameters()}
    if optimizer is not None and any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        raise ValueError("HybridParallelPlugin(zero_stage=3): the optimizer holds parameters that are not the "
                         "model's; build it on the model you boost")


def shard_zero3(model: nn.Module, optimizer, mesh, precision: PrecisionConfig) -> tuple[list[nn.Module], object]:
    """Shard the tensor-parallel `model` (on the mesh's device, fp32) over dp with FSDP2, in place, one
    unit per transformer layer plus the root; move the user's `optimizer` onto the new parameters and
    wrap it in `FSDPOptimizer`. Returns (the FSDP units, children first; the boosted optimizer or None)."""
    return shard_tensor_parallel(model, optimizer, mesh, precision, transformer_layers(model))
