"""What stands in, on a pipeline stage, for a module the stage does not run.

Owns: `AbsentEmbedding` (a segment's embeddings on a stage starting inside the segment: zeros of
the real output's shape, weightless), `ReceivedOutput` (an earlier segment's whole stack: the
output the previous stage sent for it), `AbsentModule` (a module another stage holds: calling it
is a usage error), `AbsentLayer` (what a script reading `layers[i]` gets for a layer another stage
holds: its tree with every tensor None, ColossalAI's convention), `stand_in_for` (the stand-in
of an embeddings path, module or bare parameter) and `put_at` (putting one in place, and back).
Must not know layouts, schedules or families: cut.py and run.py decide where each goes.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn
from transformers.modeling_outputs import BaseModelOutputWithPooling

_PLAIN = (int, float, str, bool, tuple, type(None))


class _Hollow(nn.Module):
    """The shape of a replaced module without its weights: its tree of submodules, an empty tensor of
    each weight's dtype (for a forward reading `embeddings.patch_embeddings.projection.weight.dtype`,
    ViT) and its plain attributes (`conv1.stride`, `embed_positions.num_embeddings`, Whisper)."""

    def __init__(self, replaced: nn.Module):
        super().__init__()
        for key, value in vars(replaced).items():
            if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN):
                self.__dict__[key] = value
        for name, p in [*replaced.named_parameters(recurse=False), *replaced.named_buffers(recurse=False)]:
            if p is not None and name not in self._buffers:
                device = "cpu" if p.is_meta else p.device           # never a meta buffer: nothing to load
                self.register_buffer(name, torch.empty(0, dtype=p.dtype, device=device), persistent=False)
        for name, child in replaced.named_children():
            self.add_module(name, _Hollow(child))


class AbsentEmbedding(_Hollow):
    """Stands in for a module of a segment's embeddings on a stage that starts inside the segment.
    Returns zeros shaped like the real module's output, so the model builds its masks from them;
    the received hidden states replace them at the chunk's first layer. A module in which nothing
    communicates (Whisper's convolutions and position table, BERT's embeddings at tp=1) gets its
    output shape from a weightless copy run on the meta device; one that communicates (a
    vocab-parallel embedding) or whose meta run fails returns zeros shaped like the received hidden
    states, which is the shape of the last module before the layers. Owns no parameter and saves
    nothing."""

    def __init__(self, replaced: nn.Module):
        super().__init__(replaced)
        self.__dict__["_meta"] = _meta_copy(replaced)
        self.hidden_like: torch.Tensor | None = None

    def forward(self, *args, **kwargs):
        meta = self.__dict__["_meta"]
        if meta is not None:
            dtype = next((p.dtype for p in meta.parameters() if p.is_floating_point()), None)
            try:
                out = meta(*_to_meta(args, dtype), **_to_meta(kwargs, dtype))
            except (RuntimeError, NotImplementedError, ValueError, TypeError):
                # a data-dependent step, or inputs shaped by a stand-in before it that answered like
                # the hidden states: the last module before the layers outputs their shape
                out = None
            if out is not None:
                where = next((b for b in self.buffers() if b.is_floating_point()), None)
                return _zeros_for(out, where)
        if self.hidden_like is None:
            raise RuntimeError("an embedding stand-in ran outside a pipeline chunk; run the model through "
                               "booster.execute_pipeline(data_iter, model, criterion, optimizer)")
        return torch.zeros_like(self.hidden_like)


def _meta_copy(module: nn.Module) -> nn.Module | None:
    """A copy of `module` with every weight on the meta device, when nothing in it communicates (no
    meshboost module, such as a vocab-parallel embedding, and no hooks); else None."""
    for m in module.modules():
        if type(m).__module__.startswith("meshboost.") or m._forward_hooks or m._forward_pre_hooks:
            return None
    memo = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _to_meta(value, dtype):
    if torch.is_tensor(value):
        return value.to("meta", dtype=dtype if value.is_floating_point() and dtype is not None else value.dtype)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v, dtype) for k, v in value.items()}
    return value


def _zeros_for(value, where: torch.Tensor | None):
    """Zeros shaped like the meta output `value`, in the dtype and on the device of `where` (the
    stand-in's own empty weights, which follow `model.to(...)`)."""
    if torch.is_tensor(value):
        dtype = where.dtype if where is not None and value.is_floating_point() else value.dtype
        return torch.zeros(value.shape, dtype=dtype, device=where.device if where is not None else "cpu")
    if isinstance(value, (tuple, list)):
        return type(value)(_zeros_for(v, where) for v in value)
    return value


def stand_in_for(module_or_param):
    """The stand-in for one embeddings path: `AbsentEmbedding` for a module; for a bare parameter
    (BLIP-2's `query_tokens`) zeros of its shape that take no memory (an expanded scalar)."""
    if isinstance(module_or_param, nn.Module):
        return AbsentEmbedding(module_or_param)
    p = module_or_param
    return torch.zeros((), dtype=p.dtype, device="cpu" if p.is_meta else p.device).expand(p.shape)


class ReceivedOutput(nn.Module):
    """Stands in for the stack of an earlier segment (an encoder, on a decoder stage): returns the
    output the previous stage sent for it (`pooler_output` None: the vision tower's pooled output
    is not carried; BLIP-2 overwrites it)."""

    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.value = value

    def forward(self, *args, **kwargs):
        return BaseModelOutputWithPooling(last_hidden_state=self.value)


class AbsentModule(nn.Module):
    """Stands in for a module another pipeline stage holds; calling it is a usage error."""

    def __init__(self, path: str, owner: str):
        super().__init__()
        self.path, self.owner = path, owner

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.path} lives on the {self.owner} pipeline stage; with pp_size > 1 run the model "
                           "through booster.execute_pipeline(data_iter, model, criterion, optimizer)")


class AbsentLayer(nn.Module):
    """What `layers[i]` answers, outside a pipeline step, for a layer another pipeline stage holds: the
    layer's tree of submodules and plain attributes with every parameter and buffer None (ColossalAI's
    convention for what a stage does not hold, so `layers[i].mlp.weight is None` tells a script to skip
    it). Built from the layer before the stage drops it; holds no tensor and is not part of the model
    (no parameters, no state_dict entries). Calling it, or any part of it, is a usage error."""

    def __init__(self, replaced: nn.Module, path: str, holders: list[int]):
        super().__init__()
        for key, value in vars(replaced).items():
            if not key.startswith("_") and key != "training" and isinstance(value, _PLAIN):
                self.__dict__[key] = value
        for name in replaced._parameters:
            self.register_parameter(name, None)
        for name in replaced._buffers:
            self.register_buffer(name, None)
        for name, child in replaced.named_children():
            self.add_module(name, AbsentLayer(child, f"{path}.{name}", holders))
        self.__dict__["_where"] = (path, holders)

    def __getitem__(self, index: int) -> nn.Module:      # a layer list inside the layer (experts)
        return self._modules[str(index)]

    def forward(self, *args, **kwargs):
        path, holders = self.__dict__["_where"]
        raise RuntimeError(f"{path} is held by pipeline rank(s) {holders}, not this one; with pp_size > 1 run the "
                           "model through booster.execute_pipeline(data_iter, model, criterion, optimizer)")


def put_at(root: nn.Module, path: str, value):
    """Put `value` (a module, or a parameter's stand-in tensor and back) at `path` under `root`;
    returns what was there."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, leaf)
    if not (isinstance(value, nn.Module) and leaf in parent._modules):
        parent._parameters.pop(leaf, None)         # a parameter becomes a plain tensor attribute, and back
        parent.__dict__.pop(leaf, None)
    setattr(parent, leaf, value)
    return old
