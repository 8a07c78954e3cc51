"""LazyInitContext: build a model on the meta device; `booster.boost` materialises only each rank's part.

Owns: the context (ColossalAI's `colossalai.lazy.LazyInitContext`) that builds modules on torch's meta
device and records the initialisation seed on every module that registers a parameter (its one
`LazyModule` record, `records.py`, which `copy.deepcopy` keeps: a deep copy of a lazy model is lazy
too, and materialises to the same values, ColossalAI's tests boost such copies), and `materialize`, which gives every
meta parameter and buffer a rank still holds after sharding and pipeline pruning its real values: one
unit at a time (a layer of a layer list, or one other module's own tensors), a full-size CPU shadow of
the unit is initialised by the model's own init (`_init_weights` of the owning HF model, else
`reset_parameters`) from a seed drawn from (context seed, unit path), and this rank keeps its shard.
Units go largest first, so the peak is about the larger of (the rank's shards) and (one unit at full
size plus its shard) plus a fixed overhead; the values do not depend on the layout
(tp, pp, dp), so every layout starts from the weights the unsharded model gets from the same seed.
Moves and casts written inside the context (`.to`, `.cpu`, `.cuda`) are `moves.py`'s: recorded there,
applied here (the shadow initialised in the dtypes the model was built in; a whole materialisation
moved where the user moved it). A module added after the model (peft's adapters, built by
`booster.enable_lora` inside a context of the same seed) carries its own init in its record
(`set_initializer`), applied after the model's. Must not know parallel layers: it reads the tensor-parallel record on
each parameter.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable

import torch
import torch.nn as nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_parameter_registration_hook,
)

from meshboost.distributed.param_info import get_tp_info, replace_keeping_object, shard_tensor
from meshboost.lazy.moves import apply_recorded_moves, as_built, patch_module_moves, record_built_dtype
from meshboost.lazy.records import lazy_record, update_lazy_record


class LazyInitContext:
    """`with LazyInitContext(): model = AutoModelForCausalLM.from_config(config)` builds the model on the
    meta device (no memory); boosting it materialises each rank's shards with the model's own random
    init. seed: the init seed (default: torch's current initial seed, equal on every rank after
    `meshboost.launch_from_torch(seed=...)`). default_device: accepted as ColossalAI takes it; the
    plugin's device is used at boost."""

    def __init__(self, default_device=None, seed: int | None = None):
        self.default_device = default_device
        self.seed = seed

    def __enter__(self) -> "LazyInitContext":
        seed = torch.initial_seed() if self.seed is None else int(self.seed)

        def tag(module, name, param):
            if param is not None:           # a module built here initialises from the context's seed
                update_lazy_record(module, seed=seed, init=None)
            record_built_dtype(module, name, param)
        self._hooks = (register_module_parameter_registration_hook(tag),
                       register_module_buffer_registration_hook(record_built_dtype))
        self._device = torch.device("meta")
        self._device.__enter__()
        self._restore = _load_pretrained_for_real(torch.device(self.default_device or "cpu"))
        self._restore_moves = patch_module_moves()
        return self

    def __exit__(self, *exc) -> None:
        self._restore_moves()
        self._restore()
        self._device.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()

    @staticmethod
    def materialize(model: nn.Module, device: torch.device | str | None = None) -> nn.Module:
        """ColossalAI's name: materialise a lazily built (unsharded) model in place, on `device`, or (None)
        on the CPU and then where `.to/.cpu/.cuda` calls inside the context moved it (`moves.py`)."""
        seed = lazy_seed(model)
        if seed is not None:
            materialize(model, copy.deepcopy(model), torch.device(device or "cpu"), seed)
            if device is None:
                apply_recorded_moves(model)
        return model


def _load_pretrained_for_real(device: torch.device):
    """Inside the context, transformers' `from_pretrained` (which refuses a meta default device) loads the
    checkpoint's real values on `device`: they are the numbers the user asked for, and a model with real
    weights is boosted as usual (no lazy init). Returns what restores the original. To load a large
    checkpoint per rank, build with `from_config` here and call `booster.load_model` after boosting: each
    rank then reads only its slices."""
    try:
        from transformers import PreTrainedModel
    except ImportError:          # no transformers: nothing to patch
        return lambda: None
    original = PreTrainedModel.__dict__["from_pretrained"]

    def from_pretrained(cls, *args, **kwargs):
        with torch.device(device):
            return original.__func__(cls, *args, **kwargs)
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)

    def restore():
        PreTrainedModel.from_pretrained = original
    return restore


def set_initializer(module: nn.Module, init: Callable[[nn.Module], None]) -> None:
    """Say how `module` (built under a LazyInitContext after its model, e.g. an adapter) is initialised at
    materialisation: `init(module)` on its full-size CPU shadow, after the model's own init."""
    record = lazy_record(module)
    if record is None or record.seed is None:
        raise ValueError(f"{type(module).__name__} was not built under a LazyInitContext: it has nothing to initialise")
    update_lazy_record(module, init=init)


def lazy_seed(model: nn.Module) -> int | None:
    """The init seed of a model built under `LazyInitContext` (or a deep copy of one): every parameter
    still on meta and every module holding parameters built there; else None."""
    params = list(model.parameters())
    if not params or not all(p.is_meta for p in params):
        return None
    records = [lazy_record(m) for m in model.modules() if any(True for _ in m.parameters(recurse=False))]
    if any(r is None or r.seed is None for r in records):
        return None
    seeds = {r.seed for r in records}
    if len(seeds) != 1:
        raise ValueError(f"the model's parameters were built under LazyInitContexts with different seeds {seeds}")
    return seeds.pop()


def _unit_seed(seed: int, path: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:7], "little")


def _units(root: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """(path, module, whole) in module order: each layer of a layer list whole, and every other module
    holding tensors of its own alone (its children are units of their own)."""
    out, inside = [], []
    for path, module in root.named_modules():
        if any(path.startswith(p + ".") for p in inside):
            continue
        if isinstance(module, nn.ModuleList):
            for i, layer in enumerate(module):
                out.append((f"{path}.{i}" if path else str(i), layer, True))
            inside.append(path)
        elif any(True for _ in module.parameters(recurse=False)) or any(
                b is not None for b in module.buffers(recurse=False)):
            out.append((path, module, False))
    return out


def _aliases(root: nn.Module) -> dict[str, list[str]]:
    """Tensor name -> every name of the same tensor in `root` (tied weights), in module order."""
    names: dict[int, list[str]] = {}
    for name, t in [*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), []).append(name)
    return {name: group for group in names.values() for name in group}


def _shadow(module: nn.Module, whole: bool) -> nn.Module:
    """A full-size CPU copy of `module` (or of its own tensors only) with HF's done-flags cleared."""
    if whole:
        shadow = copy.deepcopy(module)
    else:
        shadow = copy.copy(module)
        shadow._modules = {}
        shadow._parameters = {n: copy.deepcopy(p) for n, p in module._parameters.items()}
        shadow._buffers = {n: copy.deepcopy(b) for n, b in module._buffers.items()}
    as_built(shadow)                    # initialised in the dtypes it was built in, cast after (as eagerly)
    shadow = shadow.to_empty(device="cpu")
    for m in shadow.modules():
        m.__dict__.pop("_is_hf_initialized", None)
        for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            t.__dict__.pop("_is_hf_initialized", None)
    return shadow


def _owners(root: nn.Module) -> dict[str, object]:
    """Module path -> the init function of its nearest HF model (composite models dispatch per part)."""
    owners, out = [], {}
    for path, module in root.named_modules():
        if hasattr(module, "_init_weights") and hasattr(module, "config"):
            owners.append((path, module._init_weights))
        owner = next((fn for p, fn in reversed(owners) if p == "" or path == p or path.startswith(p + ".")), None)
        out[path] = owner
    return out


def _init(shadow: nn.Module, path: str, owners: dict) -> None:
    """Post-order over the shadow (children first, as transformers initialises); modules whose record
    names their own init get it after, untouched by the model's."""
    own = []
    for name, module in reversed(list(shadow.named_modules())):
        full = f"{path}.{name}" if name else path
        record = lazy_record(module)
        if record is not None and record.init is not None:
            own.append((module, record.init))
            continue
        fn = owners.get(full)
        if fn is not None:
            fn(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for module, init in own:
        init(module)


@torch.no_grad()
def materialize(model: nn.Module, original: nn.Module, device: torch.device, seed: int) -> None:
    """Give every meta parameter and buffer of `model` (sharded and pruned, same names as `original`,
    the model as built) its values: `original`'s init, unit by unit, this rank's shard kept."""
    real = {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers(remove_duplicate=False))}
    owners = _owners(original)
    aliases = _aliases(original)
    # largest units first: their full-size shadows then come while the rank holds little else
    units = sorted(_units(original), key=lambda u: -sum(t.numel() for t in [*u[1].parameters(recurse=u[2]),
                                                                            *u[1].buffers(recurse=u[2])]))
    for path, unit, whole in units:
        prefix = f"{path}." if path else ""
        tensors = [*unit.named_parameters(recurse=whole), *unit.named_buffers(recurse=whole)]
        # a tied tensor takes its value from the first unit holding it, under any of its names: a pipeline's
        # last stage, which holds the LM head but not the embedding, still gets the embedding's values
        wanted = [(name, local, real[name]) for local, _ in tensors for name in aliases[prefix + local]
                  if name in real and real[name] is not None and real[name].is_meta]
        if not wanted:
            continue
        shadow = _shadow(unit, whole)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_unit_seed(seed, path))
            _init(shadow, path, owners)
        values = {**dict(shadow.named_parameters(remove_duplicate=False)),
                  **dict(shadow.named_buffers(remove_duplicate=False))}
        for name, local, tensor in wanted:
            if not tensor.is_meta:             # tied: materialised through another name already
                continue
            full = values[local].detach()
            info = get_tp_info(tensor)
            value = shard_tensor(full, info) if info is not None else full.clone()
            replace_keeping_object(tensor, value.to(device=device, dtype=tensor.dtype))
    left = [n for n, t in real.items() if t is not None and t.is_meta]
    if left:
        raise RuntimeError(f"LazyInitContext: {left[:3]} found no initialiser in the model as built")


__all__ = ["LazyInitContext", "lazy_seed", "materialize", "set_initializer"]
