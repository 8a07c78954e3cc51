"""ZeRO-3 under tensor parallelism: FSDP2 over the data-parallel ranks of a tensor-parallel model.

Owns: sharding an already tensor-parallel model (ShardFormer's Column/RowParallel layers, whose
plain-tensor parameters hold this rank's tp shard and carry its record) over the data-parallel
sub-mesh with `wrap.apply_fsdp` (one unit per transformer layer plus the root): each tp-local
parameter becomes a DTensor holding 1/dp of it, FSDP2 all-gathers it back to the tp-local weight
before a unit's forward and backward (the tp collectives then run on whole tp shards, as without
ZeRO) and reduce-scatters the gradients over dp. The parameter records (`tp_info`, pipeline ties,
gradient hooks) are carried onto the new DTensor parameters through `param_info`, so the grad norm,
checkpoint gathering and loading read them as for every other layout, and the gradient hooks (sums
over tp: sequence parallelism, shared q/k norms, replicated kv heads) are registered on the
unsharded parameters FSDP2 hands autograd. Precision is FSDP2's MixedPrecisionPolicy (fp32 shards
are the masters) with `FSDPOptimizer`'s step. Must not check what a plugin accepts, or implement
sharding, reduction or checkpoints itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from meshboost.distributed.param_info import attach_records, carry_grad_hooks, grad_hooks, records_of
from meshboost.fsdp.config import FSDPConfig
from meshboost.fsdp.wrap import Layers, apply_fsdp, boost_optimizer, prepare
from meshboost.optim import PrecisionConfig


@torch.no_grad()
def _carry_grad_hooks(model: nn.Module, hooked: set[str]) -> None:
    """Register the gradient hooks recorded on the sharded parameters named in `hooked` on the
    parameters autograd sees under FSDP2. FSDP2 replaces each parameter by a DTensor shard, and during
    forward and backward the module holds an unsharded parameter that FSDP2 creates at a unit's first
    all-gather and reuses at every later one (storage freed and refilled); its gradient is what FSDP2
    reduce-scatters. So each unit is unsharded once here, the hooks go on its unsharded parameters
    (they then run before FSDP2 reads the gradient, as they ran before DDP or ZeRO did), and it is
    resharded. Every rank does this for every unit (the all-gathers are collectives over dp), one
    unit at a time."""
    if not hooked:
        return
    sharded = dict(model.named_parameters())
    left = set(hooked)
    for module in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        module.unshard()
        for name, p in model.named_parameters():
            if name in left and p is not sharded[name]:
                carry_grad_hooks(sharded[name], p)
                left.discard(name)
        module.reshard()
    if left:
        raise RuntimeError(f"HybridParallelPlugin(zero_stage=3): could not find FSDP2's unsharded parameters for "
                           f"{sorted(left)[:4]}, whose gradient hooks would be lost; use zero_stage=1 or 2")


def shard_tensor_parallel(model: nn.Module, optimizer, mesh, precision: PrecisionConfig,
                          layers: Layers, reshard_after_forward: bool = True) -> tuple[list[nn.Module], object]:
    """Shard the tensor-parallel `model` (on the mesh's device, fp32) over dp with FSDP2, in place,
    one unit per module of `layers`; move the user's `optimizer` onto the new parameters and wrap it
    in `FSDPOptimizer`. reshard_after_forward: FSDP2's (False keeps each unit gathered from its forward
    until its backward is done: a pipeline stage gathers once per step). Returns (the FSDP units,
    children first; the boosted optimizer or None)."""
    names = {id(p): n for n, p in model.named_parameters()}          # the optimizer's, before FSDP2 swaps them
    # The records each parameter carries (tp_info, pipeline ties, gradient hooks): FSDP2's new parameters lack them.
    records = {n: records_of(p) for n, p in model.named_parameters()}
    # compute in the plugin's precision, gradients reduce-scattered in fp32 (the masters' dtype)
    config = FSDPConfig(precision=precision, reshard_after_forward=reshard_after_forward)
    prepare(model, config, mesh)      # floating buffers in the compute dtype, as zero_stage 0-2's model.to(dtype)
    units = apply_fsdp(model, config, mesh, layers)
    for n, p in model.named_parameters():
        attach_records(p, records[n])
    _carry_grad_hooks(model, {n for n, p in model.named_parameters() if grad_hooks(p)})
    if optimizer is not None:
        optimizer = boost_optimizer(optimizer, names, model, mesh, precision)
    return units, optimizer
