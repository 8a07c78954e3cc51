"""HybridParallelPlugin's torch DDP: who averages which gradients when DDP is the data-parallel reducer
(zero_stage=0, pp_size=1). Dense weights are DDP's, over the mesh's gradient axes; expert-parallel ones
(their records say edp) are averaged by meshboost's optimizer at the step, so DDP must never see them.

Owns: `reductions` (trainable parameters grouped by the group averaging them, from the mesh's
`reduction_axes`) and `wrap_ddp`. Must not decide whether DDP is used: `config.dp_reducer` does.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from meshboost.distributed.quantized import is_nf4
from meshboost.optim import MixedPrecisionOptimizer
from meshboost.plugins.ddp_hooks import register_counting_allreduce, register_fp8_allreduce


def reductions(model: nn.Module, mesh) -> list[tuple[list, object]]:
    """[(trainable parameters, the group averaging their gradients)], grouped as their records say (the
    mesh answers `reduction_axes`: dp for dense weights, edp for expert-parallel ones), dense first; always
    one entry for the dense weights, even when there are none."""
    by_axes: dict[tuple[str, ...], list] = {mesh.dims.grad_axes(): []}
    for p in model.parameters():
        if p.requires_grad:
            by_axes.setdefault(mesh.reduction_axes(p), []).append(p)
    return [(params, mesh.group(*axes)) for axes, params in by_axes.items()]


def wrap_ddp(model: nn.Module, optimizer, mesh, ddp_kwargs: dict, fp8_communication: bool) -> nn.Module:
    """`model` in torch DDP over the dense weights' group (or `model` itself when no dense weight trains:
    LoRA on experts alone, which DDP would refuse); the experts' groups handed to the optimizer's step."""
    found = reductions(model, mesh)
    params, group = found[0]
    # DDP averages the dense weights and must not see the experts, frozen ones (LoRA) included: it would
    # broadcast dp rank 0's over ranks holding others. The optimizer averages the experts, at step. Nor the
    # frozen NF4 bases (QLoRA): its broadcast of a tensor subclass would overwrite their 4-bit data
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [
        n for n, p in model.named_parameters() if mesh.reduction_axes(p) != mesh.dims.grad_axes() or is_nf4(p)])
    if len(found) > 1:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            optimizer.average_at_step(found[1:])
        elif optimizer is not None:          # nothing would average the experts: refuse (every rank)
            raise TypeError(f"expert parallelism with torch DDP averages the experts' gradients in meshboost's "
                            f"optimizer step; {type(optimizer).__name__} is not one: pass the torch optimizer "
                            "itself to boost")
    if not params:
        return model
    device = mesh.device
    module = DistributedDataParallel(model, process_group=group, device_ids=[device] if device.type == "cuda" else None,
                                     **ddp_kwargs)
    if fp8_communication:
        register_fp8_allreduce(module, group)
    else:
        register_counting_allreduce(module, group)
    return module
