"""Cutting a model into torch FSDP2 units and sharding it (`fully_shard`), and moving the user's
optimizer onto the sharded parameters.

Owns: which modules become their own `fully_shard` unit (the transformer layers the caller names,
or an FSDP1-style `auto_wrap_policy`), sharding them children first and the root last over the
data-parallel mesh, forward prefetching, the pre-sharding touches (broadcast from rank 0, buffer
dtype), pointing the user's optimizer (and a state it already has) at the new parameters, and
wrapping it in `FSDPOptimizer`. Must not step, scale or save, and must not read a model family's
layout itself: the caller passes the layers (plugins/fsdp_wrap.py reads them from transformers'
`_no_split_modules` or the pipeline layout).
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from meshboost.distributed import comm
from meshboost.fsdp.config import FSDPConfig
from meshboost.fsdp.optimizer import FSDPOptimizer
from meshboost.optim import PrecisionConfig

logger = logging.getLogger("meshboost.fsdp")

Layers = list[tuple[str, nn.Module]]    # (qualified name, module) of every transformer layer, in forward order


def _policy_modules(model: nn.Module, policy, ignored: set[int]) -> list[nn.Module]:
    """The modules an FSDP1 `auto_wrap_policy` wraps, children before parents: descend where
    policy(recurse=True) allows, wrap where policy(recurse=False) agrees given the parameters not
    already wrapped below (FSDP1's rule; the root is always a unit of its own)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module, is_root: bool) -> int:
        numel = sum(p.numel() for p in module.parameters() if id(p) not in ignored)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = sum(visit(child, False) for child in module.children())
        if not is_root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            units.append(module)
            return numel
        return wrapped

    visit(model, True)
    return units


def shard_units(model: nn.Module, config: FSDPConfig, ignored: set[int], layers: Layers) -> list[nn.Module]:
    """The modules to shard as units of their own, parents after children: the `layers`, unless an
    `auto_wrap_policy` decides. A layer whose weight is also used outside it (an input embedding tied
    to the LM head) stays with the root: an FSDP2 unit gathers its weights only for its own forward."""
    if config.auto_wrap_policy is not None:
        return _policy_modules(model, config.auto_wrap_policy, ignored)
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    units = []
    for prefix, module in layers:
        params = [p for p in module.parameters() if id(p) not in ignored]
        if params and all(n.startswith(prefix + ".") for p in params for n in names_of[id(p)]):
            units.append(module)
    return units[::-1]


@torch.no_grad()
def prepare(model: nn.Module, config: FSDPConfig, mesh) -> None:
    """What must happen before sharding: rank 0's weights and buffers everywhere (sync_module_states:
    an all-reduce of rank 0's values and everyone else's zeros, exact), floating buffers in
    `buffer_dtype` (None: the compute dtype) unless `cast_buffers` is False. No collective without
    sync_module_states."""
    if config.sync_module_states and mesh.dp_size > 1:
        for t in [*model.parameters(), *model.buffers()]:
            on_device = t.detach().to(mesh.device, copy=True)
            if mesh.dp_rank != 0:
                on_device.zero_()
            comm.all_reduce(on_device, mesh.dp_group)
            t.copy_(on_device)
    if config.cast_buffers:
        dtype = config.buffer_dtype or config.dtype
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                if buf is not None and buf.is_floating_point():
                    setattr(module, name, buf.to(dtype))


def replica_units(model: nn.Module, mesh, ignored: set[int]) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(module, axes) for every module holding parameters whose gradient the mesh averages over other
    axes than the dense weights' (expert-parallel experts: over edp, the dp ranks holding the same
    experts), children first: each becomes a unit of its own sharded over those axes, before the
    layers around it (whose units then skip its parameters), as torchtitan shards its experts (under HSDP
    on the (dp_replicate, edp_shard) mesh: replicated as the dense weights are). Pure: a
    module mixing kinds is refused on every rank alike."""
    dense, out = mesh.dims.grad_axes(), []
    for name, module in model.named_modules():
        axes = {mesh.reduction_axes(p) for p in module.parameters(recurse=False) if id(p) not in ignored}
        if axes <= {dense}:
            continue
        if len(axes) > 1:
            raise NotImplementedError(f"zero_stage=3: {name or type(module).__name__} holds parameters averaged over "
                                      f"different mesh axes {sorted(axes)}; FSDP2 shards a module's own parameters "
                                      "over one mesh. Use zero_stage 1 or 2 for this model")
        out.append((module, axes.pop()))
    return out[::-1]


def apply_fsdp(model: nn.Module, config: FSDPConfig, mesh, layers: Layers) -> list[nn.Module]:
    """Shard `model` in place with FSDP2 over the data-parallel mesh: the modules whose weights
    other replicas average (`replica_units`, each over its own axes), every unit (`shard_units`),
    then the root. Returns the units (children first). The parameters become new objects (DTensors)."""
    ignored_params = {p for m in config.ignored_modules for p in m.parameters()}
    own_axes = replica_units(model, mesh, {id(p) for p in ignored_params})
    units = shard_units(model, config, {id(p) for p in ignored_params}, layers)
    kinds, root_kind = sorted({type(u).__name__ for u in units}), type(model).__name__   # before FSDP renames them
    # the dense weights' data-parallel axes (the mesh's answer: dp, dp x cp with a context axis; with HSDP the 2-D
    # (replicate, shard) mesh, on which FSDP2 shards over the second and all-reduces gradients over the first)
    common = dict(mesh=mesh.fsdp_mesh(), ignored_params=ignored_params or None)
    offload = config.offload_policy()
    if offload is not None:
        common["offload_policy"] = offload
    # None: FSDP2's default, free gathered weights after forward except at the root (needed first in backward).
    reshard = None if config.reshard_after_forward else False
    for unit, axes in own_axes:
        fully_shard(unit, reshard_after_forward=reshard, mp_policy=config.mp_policy(root=False),
                    **{**common, "mesh": mesh.fsdp_mesh(axes=axes)})
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard, mp_policy=config.mp_policy(root=False), **common)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=config.mp_policy(root=True), **common)
    if config.forward_prefetch:
        in_order = units[::-1]
        for i, unit in enumerate(in_order):
            unit.set_modules_to_forward_prefetch(in_order[i + 1:i + 1 + config.forward_prefetch])
    if config.verbose and (not dist.is_initialized() or dist.get_rank() == 0):
        logger.warning("meshboost FSDP2: %d units (%s) + root %s over dp=%d; compute %s, offload %s, reshard after "
                       "forward %s, prefetch %d", len(units), kinds, root_kind, mesh.dp_size,
                       config.precision.precision, config.cpu_offload,
                       config.reshard_after_forward, config.forward_prefetch)
    return [unit for unit, _ in own_axes] + units


def move_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module) -> None:
    """Point the user's param groups at the sharded parameters that replaced theirs (by name; groups
    and hyperparameters are kept). `names`: id(original parameter) -> its name, taken before sharding."""
    sharded = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [sharded[names[id(p)]] for p in group["params"]]


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


def boost_optimizer(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module, mesh,
                    precision: PrecisionConfig, wrapper: type[FSDPOptimizer] = FSDPOptimizer) -> FSDPOptimizer:
    """The user's `optimizer` moved onto the sharded `model` (`carry_state`) and wrapped in
    `FSDPOptimizer` (or the subclass `wrapper`) with `precision`'s step (compute dtype, clipping, fp16 loss scaler)."""
    carry_state(optimizer, names, model)
    return wrapper(optimizer, mesh, precision)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule) or any(isinstance(m, FSDPModule) for m in model.modules())


@contextlib.contextmanager
def no_gradient_sync(module: nn.Module):
    """Backward inside the block keeps unreduced gradients (full size) and adds to them; the first
    backward after it reduce-scatters the sum."""
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def reshard_all(model: nn.Module) -> nn.Module:
    """Point every FSDP2 module back at its sharded (DTensor) parameters. FSDP2 leaves the root's
    gathered weights in place after a forward that no backward follows (an evaluation under no_grad),
    so `named_parameters()` would hand checkpoint code plain, freed-at-any-moment compute-dtype copies
    (a load then wrote into freed storage). Local, no communication; the next forward or backward
    gathers again where needed."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    return model
