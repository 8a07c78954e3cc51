"""ZeRO-3 composed with the other axes: HybridParallelPlugin(zero_stage=3) with tp, cp, pp and ep.

Owns: what the plugin accepts for zero_stage=3 (models and optimizers it cannot shard are refused
here; the combinations of settings, in config.py) and the call into the FSDP2 engine
(`meshboost.fsdp.shard_tensor_parallel`, which shards the tensor-parallel model over dp and carries
its records and gradient hooks; expert-parallel experts over their own replicas, `fsdp/wrap.py`) with
the transformer layers the model (or this pipeline rank's cut of it) holds as units; with pipeline
stages, pointing the pipeline's tied weights at FSDP2's parameters and handing the schedule its
`StepSharding` (`fsdp/pipeline.py`). Must not shard, reduce or move records itself: meshboost.fsdp and
meshboost.distributed.param_info do.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.booster import OptimizerWrapper
from meshboost.fsdp import StepSharding, is_sharded, shard_tensor_parallel
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


def shard_zero3(model: nn.Module, optimizer, mesh, precision: PrecisionConfig, stages=None,
                reshard_after_forward: bool | None = None) -> tuple[object, StepSharding | None]:
    """Shard the tensor-parallel `model` (on the mesh's device, fp32; with pipeline `stages`, this rank's
    cut of it) over dp with FSDP2, in place, one unit per transformer layer it holds plus the root; move
    the user's `optimizer` onto the new parameters and wrap it in `FSDPOptimizer`. With stages, the
    weights the pipeline ties across stages are pointed at their sharded replacements and the
    returned `StepSharding` is what the schedule calls around each step. reshard_after_forward: None
    is True without stages and False with them (each stage gathers once per step, not per micro-batch).
    Returns (the boosted optimizer or None, the StepSharding or None)."""
    if reshard_after_forward is None:
        reshard_after_forward = stages is None
    names = {id(p): n for n, p in model.named_parameters()}
    _, optimizer = shard_tensor_parallel(model, optimizer, mesh, precision, transformer_layers(model),
                                         reshard_after_forward)
    if stages is None:
        return optimizer, None
    sharded = dict(model.named_parameters())
    stages.ties = [(ranks, [sharded[names[id(p)]] for p in params]) for ranks, params in stages.ties]
    return optimizer, StepSharding(model)
