"""Auxiliary-loss-free load balancing (DeepSeek-V3's bias update, Megatron's `moe_router_bias_update_rate`).

Owns: finding the routers that carry an `e_score_correction_bias`, counting the tokens their top-k sends
to each expert (a forward hook on the module whose output holds the selected expert ids: the model's own
selection, no forward copied), and, once per optimizer step, moving every bias by
rate * sign(mean load - expert load), the loads summed over every forward since the last step
(micro-batches, accumulation) and all-reduced over the dense replicas (dp x cp, which holds ep): the
whole global batch's, identical on every rank holding the layer. The counts live in one typed record per
layer held by `RouterBiasBalancer`, never on the modules. Must not know a family.
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshboost.distributed import comm

BIAS = "e_score_correction_bias"


def check_rate(rate) -> float:
    """The rate as a float, or ValueError naming it: a finite number >= 0. NaN or inf would pass a `< 0`
    test and turn every bias NaN after one step while the loss looks normal (the bias only picks experts)."""
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not math.isfinite(rate) or rate < 0:
        raise ValueError(f"moe_router_bias_update_rate={rate!r} must be a finite number >= 0 (0 turns the update "
                         "off; DeepSeek-V3 uses 1e-3)")
    return float(rate)


def bias_routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every module holding a correction bias, in model order."""
    return [(n, m) for n, m in model.named_modules()
            if torch.is_tensor(getattr(m, BIAS, None)) and not getattr(m, BIAS).requires_grad]


def check_model(model: nn.Module, rate: float) -> None:
    """Pure: a rate that is not a finite number >= 0 (a config changed after it was built), or one on a model
    without correction biases, is refused (the same error on every rank)."""
    rate = check_rate(rate)
    if rate > 0 and not bias_routers(model):
        raise ValueError(f"moe_router_bias_update_rate={rate}: {type(model).__name__} has no router with a frozen "
                         f"`{BIAS}` (DeepSeek-V3, GLM-4-MoE and similar carry one); drop the keyword or pass 0.0")


@dataclass
class LayerLoads:
    """One router's bias and the tokens its top-k sent to each expert since the last step."""

    name: str
    owner: weakref.ref
    loads: torch.Tensor


class RouterBiasBalancer:
    """Counts every local router's loads in forward (training mode) and updates the biases in `step()`."""

    def __init__(self, model: nn.Module, rate: float, group):
        self.rate, self.group, self.layers, self.handles = rate, group, [], []
        for name, owner in bias_routers(model):
            bias = getattr(owner, BIAS)
            record = LayerLoads(name, weakref.ref(owner), torch.zeros(bias.numel(), dtype=torch.int64,
                                                                      device=bias.device))
            self.layers.append(record)
            # the bias lives on the router (DeepSeek-V3) or on the MoE block whose `gate` selects (HY-V3)
            router = owner.gate if isinstance(getattr(owner, "gate", None), nn.Module) else owner
            self.handles.append(router.register_forward_hook(self._counter(record)))

    @staticmethod
    def _counter(record: LayerLoads):
        def hook(module, args, output):
            if not module.training or not torch.is_grad_enabled():
                return                      # evaluation (and no-grad recomputation) does not count
            outs = output if isinstance(output, (tuple, list)) else (output,)
            ids = [o for o in outs if torch.is_tensor(o) and not o.is_floating_point() and o.dtype != torch.bool]
            if not ids:
                raise RuntimeError(f"moe_router_bias_update_rate: {record.name}'s router returned no expert ids "
                                   f"(outputs {[type(o).__name__ for o in outs]}); its loads cannot be counted")
            sel = ids[-1].reshape(-1).long()
            sel = sel[(sel >= 0) & (sel < record.loads.numel())]
            record.loads += torch.bincount(sel, minlength=record.loads.numel()).to(record.loads.device)
        return hook

    @torch.no_grad()
    def step(self) -> None:
        """Loads of the global batch (one all-reduce over the dense replicas), bias += rate * sign(mean - load),
        counts reset. Every rank of the group calls it (the optimizer's step)."""
        if not self.layers:
            return
        loads = torch.stack([r.loads for r in self.layers])
        comm.all_reduce(loads, self.group)
        experts = loads.shape[1]
        # sign(total / E - load) in integers: exact, the same on every rank
        direction = torch.sign(loads.sum(dim=1, keepdim=True) - experts * loads)
        for record, d in zip(self.layers, direction):
            owner = record.owner()
            if owner is not None:
                bias = getattr(owner, BIAS)
                bias.data += (self.rate * d.to(torch.float64)).to(bias.dtype)
            record.loads.zero_()


def install(model: nn.Module, optimizer, rate: float, mesh, seq_parallel: bool = False) -> RouterBiasBalancer | None:
    """With rate > 0 and a boosted optimizer: count this stage's routers and update them first in every
    `optimizer.step()` (its pre-update callbacks run on every rank, before anything changes). seq_parallel:
    each tp rank routes its own chunk of the sequence, so the loads are summed over tp too."""
    if rate == 0 or optimizer is None:
        return None
    if not hasattr(optimizer, "check_before_update"):
        raise NotImplementedError(f"moe_router_bias_update_rate={rate} needs meshboost's optimizer wrapper "
                                  f"(zero_stage 0, 1 or 2), not {type(optimizer).__name__}")
    balancer = RouterBiasBalancer(model, rate, mesh.group(*mesh.dims.grad_axes(), *(("tp",) if seq_parallel else ())))
    optimizer.check_before_update(balancer.step)
    return balancer
