"""ZeRO-3 under tensor parallelism: HybridParallelPlugin(tp_size=T, zero_stage=3) on torch FSDP2.

Owns: sharding an already tensor-parallel model (ShardFormer's Column/RowParallel layers, whose
plain-tensor parameters hold this rank's tp shard and carry its record) over the data-parallel
sub-mesh with the FSDP2 engine of `fsdp_wrap.py` (one unit per transformer layer plus the root):
each tp-local parameter becomes a DTensor holding 1/dp of it, FSDP2 all-gathers it back to the
tp-local weight before a unit's forward and backward (the tp collectives then run on whole tp
shards, as without ZeRO) and reduce-scatters the gradients over dp. The parameter records
(`tp_info`, pipeline ties) are moved onto the new DTensor parameters, so the grad norm, checkpoint
gathering and loading read them as for every other layout, and the gradient hooks some parameters
carry (sums over tp: sequence parallelism, shared q/k norms, replicated kv heads) are moved onto the
unsharded parameters FSDP2 hands autograd. Precision is FSDP2's MixedPrecisionPolicy (fp32 shards
are the masters) with `FSDPOptimizer`'s step. Also refuses models and optimizers it cannot shard
(pipeline stages are refused with the other settings, in config.py). Must not implement sharding,
reduction or checkpoints itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from meshboost.booster import OptimizerWrapper
from meshboost.optim import PrecisionConfig
from meshboost.plugins.fsdp_config import FSDPConfig
from meshboost.plugins.fsdp_optimizer import FSDPOptimizer
from meshboost.plugins.fsdp_wrap import apply_fsdp, is_sharded, move_optimizer

ZERO3 = 3


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


def carry_state(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module) -> None:
    """Point the user's param groups at the parameters FSDP2 put in place of theirs (`move_optimizer`)
    and key the state of an optimizer that already stepped to them, still whole: `FSDPOptimizer` cuts it
    to this rank's shard (MixedPrecisionOptimizer's carried state). `names`: id(original) -> name."""
    state = {names[id(p)]: optimizer.state.pop(p) for g in optimizer.param_groups for p in g["params"]
             if p in optimizer.state}
    move_optimizer(optimizer, names, model)
    sharded = dict(model.named_parameters())
    for name, entry in state.items():
        optimizer.state[sharded[name]] = entry


def _grad_hooks(model: nn.Module) -> dict[str, list]:
    """name -> the gradient hooks on that parameter (a kv-head shard held by several tp ranks, a
    per-head q/k norm or a sequence-parallel replicated weight, whose gradient is summed over tp)."""
    return {n: list(p._backward_hooks.values()) for n, p in model.named_parameters()
            if getattr(p, "_backward_hooks", None)}


@torch.no_grad()
def _carry_grad_hooks(model: nn.Module, hooks: dict[str, list]) -> None:
    """Register `hooks` on the parameters autograd sees under FSDP2. FSDP2 replaces each parameter by a
    DTensor shard, and during forward and backward the module holds an unsharded parameter that FSDP2
    creates at a unit's first all-gather and reuses at every later one (storage freed and refilled);
    its gradient is what FSDP2 reduce-scatters. So each unit is unsharded once here, the hooks go on
    its unsharded parameters (they then run before FSDP2 reads the gradient, as they ran before DDP or
    ZeRO did), and it is resharded. Every rank does this for every unit (the all-gathers are
    collectives over dp), one unit at a time."""
    if not hooks:
        return
    sharded = dict(model.named_parameters())
    left = dict(hooks)
    for module in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        module.unshard()
        for name, p in model.named_parameters():
            if name in left and p is not sharded[name]:
                for hook in left.pop(name):
                    p.register_hook(hook)
        module.reshard()
    if left:
        raise RuntimeError(f"HybridParallelPlugin(zero_stage=3): could not find FSDP2's unsharded parameters for "
                           f"{sorted(left)[:4]}, whose gradient hooks would be lost; use zero_stage=1 or 2")


def shard_zero3(model: nn.Module, optimizer, mesh, precision: PrecisionConfig) -> tuple[list[nn.Module], object]:
    """Shard the tensor-parallel `model` (on the mesh's device, fp32) over dp with FSDP2, in place;
    move the user's `optimizer` onto the new parameters and wrap it in `FSDPOptimizer`. Returns
    (the FSDP units, children first; the boosted optimizer or None)."""
    hooks = _grad_hooks(model)
    names = {id(p): n for n, p in model.named_parameters()}          # the optimizer's, before FSDP2 swaps them
    # The records each parameter carries (tp_info, pipeline ties): FSDP2's new parameters lack them.
    records = {n: {k: v for k, v in p.__dict__.items() if not k.startswith("_")}
               for n, p in model.named_parameters()}
    # compute in the plugin's precision, gradients reduce-scattered in fp32 (the masters' dtype)
    units = apply_fsdp(model, FSDPConfig(precision=precision), mesh)
    for n, p in model.named_parameters():
        p.__dict__.update(records[n])
    _carry_grad_hooks(model, hooks)
    if optimizer is not None:
        carry_state(optimizer, names, model)
        optimizer = FSDPOptimizer(optimizer, mesh, precision=precision.precision, max_norm=precision.max_norm,
                                  norm_type=precision.norm_type, scaler_config=precision.scaler)
    return units, optimizer
