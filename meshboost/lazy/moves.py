"""What `.to(...)`, `.cpu()` and `.cuda()` do to a module built under LazyInitContext, inside the context.

Owns: the records that let a lazy model be moved and cast before it has values (ColossalAI's examples write
`with LazyInitContext(): model = Model(cfg).cuda()`, which torch refuses on meta tensors with "Cannot copy
out of meta tensor"): a cast applies on the meta tensors at once (the model reports the dtype the user asked
for, an optimizer built on it sees it), the dtype each tensor was built in is kept (its initialiser runs in
that dtype at materialisation and the value is then cast, as an eager model initialised and then cast is),
and a device move is recorded and applied when the model is materialised whole (`LazyInitContext.materialize`;
at `boost` the plugin's device places the shards); both records are fields of the module's one `LazyModule`
(`records.py`). Modules holding no meta tensor move as torch moves them. Must not materialise anything itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from meshboost.lazy.records import lazy_record, update_lazy_record


def record_built_dtype(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Called when `module` registers `tensor` under `name` inside the context: the dtype it is built (and
    initialised) in, before any cast the user applies."""
    if tensor is not None:
        built = lazy_record(module).built_dtypes if lazy_record(module) is not None else {}
        update_lazy_record(module, built_dtypes={**built, name: tensor.dtype})


def _holds_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _record_move(module: nn.Module, device: torch.device) -> None:
    """A move of `module` overrides every earlier move of its submodules, as torch's would."""
    for sub in module.modules():
        record = lazy_record(sub)
        if record is not None and record.device is not None:
            update_lazy_record(sub, device=None)
    update_lazy_record(module, device=device)


def patch_module_moves():
    """Inside the context, `Module.to/.cpu/.cuda` on a module holding meta tensors: the cast (and memory
    format) applies on meta, a device other than meta is recorded. Returns what restores torch's methods."""
    originals = {name: nn.Module.__dict__[name] for name in ("to", "cpu", "cuda")}

    def to(self, *args, **kwargs):
        if not _holds_meta(self):
            return originals["to"](self, *args, **kwargs)
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and device.type != "meta":
            _record_move(self, device)
        if dtype is not None:
            originals["to"](self, dtype)
        if memory_format is not None:
            originals["to"](self, memory_format=memory_format)
        return self

    def cpu(self):
        if not _holds_meta(self):
            return originals["cpu"](self)
        _record_move(self, torch.device("cpu"))
        return self

    def cuda(self, device=None):
        if not _holds_meta(self):
            return originals["cuda"](self, device)
        _record_move(self, torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda"))
        return self

    nn.Module.to, nn.Module.cpu, nn.Module.cuda = to, cpu, cuda

    def restore():
        for name, method in originals.items():
            setattr(nn.Module, name, method)
    return restore


def as_built(shadow: nn.Module) -> None:
    """Give the (meta) tensors of a shadow copy the dtypes they were built in, so the model's own
    initialiser runs as it ran for an eager model before the user's cast."""
    for module in shadow.modules():
        record = lazy_record(module)
        for name, dtype in (record.built_dtypes if record is not None else {}).items():
            if name in module._parameters and module._parameters[name] is not None:
                param = module._parameters[name]
                if param.dtype != dtype:
                    param.data = param.data.to(dtype)
            elif module._buffers.get(name) is not None and module._buffers[name].dtype != dtype:
                module._buffers[name] = module._buffers[name].to(dtype)


def apply_recorded_moves(model: nn.Module) -> None:
    """Apply the moves recorded inside the context to a materialised model, outermost module first (a
    recorded move of a submodule came after its ancestors' moves: `_record_move` drops the older ones)."""
    for module in model.modules():
        record = lazy_record(module)
        if record is not None and record.device is not None:
            update_lazy_record(module, device=None)
            module.to(record.device)
