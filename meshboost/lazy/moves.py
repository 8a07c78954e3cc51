"""What `.to(...)`, `.cpu()` and `.cuda()` do to a module built under LazyInitContext, inside the context.

Owns: the records that let a lazy model be moved and cast before it has values (ColossalAI's examples write
`with LazyInitContext(): model = Model(cfg).cuda()`, which torch refuses on meta tensors with "Cannot copy
out of meta tensor"): a cast applies on the meta tensors at once (the model reports the dtype the user asked
for, an optimizer built on it sees it), the dtype each tensor was built in is kept (its initialiser runs in
that dtype at materialisation and the value is then cast, as an eager model initialised and then cast is),
and a device move is recorded on the module and applied when the model is materialised whole
(`LazyInitContext.materialize`; at `boost` the plugin's device places the shards). Modules holding no meta
tensor move as torch moves them. Must not materialise anything itself.
"""

from __future__ import annotations

import torch
import torch.nn as nn

BUILT_DTYPES_ATTR = "_meshboost_lazy_built_dtypes"     # module -> {tensor name: dtype at registration}
DEVICE_ATTR = "_meshboost_lazy_device"                 # module -> the device a move inside the context asked for


def record_built_dtype(module: nn.Module, name: str, tensor: torch.Tensor | None) -> None:
    """Called when `module` registers `tensor` under `name` inside the context: the dtype it is built (and
    initialised) in, before any cast the user applies."""
    if tensor is not None:
        module.__dict__.setdefault(BUILT_DTYPES_ATTR, {})[name] = tensor.dtype


def _holds_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def _record_move(module: nn.Module, device: torch.device) -> None:
    """A move of `module` overrides every earlier move of its submodules, as torch's would."""
    for sub in module.modules():
        sub.__dict__.pop(DEVICE_ATTR, None)
    module.__dict__[DEVICE_ATTR] = device


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
        for name, dtype in module.__dict__.get(BUILT_DTYPES_ATTR, {}).items():
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
        device = module.__dict__.pop(DEVICE_ATTR, None)
        if device is not None:
            module.to(device)
