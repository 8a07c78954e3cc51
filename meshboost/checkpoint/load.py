"""Load a HuggingFace-format checkpoint into a model at any tensor-parallel layout, reading only
the slices this rank owns.

Owns: finding the weight files of a folder (single file or index, safetensors or torch pickle),
refusing incomplete folders, naming a weight file that is truncated or corrupt (`open_weights`),
putting back a folder a dead save left aside (`atomic.recover`), mapping checkpoint names onto
parameter names (with or without the base-model prefix; tied weights through `names.py`), reading
each parameter's owned slices as its `TensorParallelInfo` says (`param_info.shard_from`: vocab
padding, fused blocks), and materialising parameters of a model built on the meta device. Must not
communicate: every rank reads its own slices, so no rank ever holds more than its share of a tensor
(safetensors reads slices lazily; torch pickles are memory-mapped).
"""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import torch
import torch.nn as nn

from meshboost.checkpoint.atomic import recover
from meshboost.checkpoint.names import ParamNames
from meshboost.distributed.param_info import (
    TensorParallelInfo, get_tp_info, is_dtensor, replace_keeping_object, shard_from)
from meshboost.distributed.quantized import dequantized, is_nf4

_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
_SINGLES = ("model.safetensors", "pytorch_model.bin")
# Checkpoint keys that transformers itself ignores (buffers that became non-persistent).
_IGNORABLE = re.compile(r"(^|\.)(position_ids|rotary_emb\.inv_freq)$")


def open_weights(file: str, opener: Callable[[], object]):
    """`opener()`, the file read by safetensors or torch; a file that cannot be parsed (truncated by
    an interrupted save or copy, or corrupt) raises an error naming it and saying what to do, in
    place of the reader's own ("incomplete metadata", "failed finding central directory")."""
    from safetensors import SafetensorError
    try:
        return opener()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        raise                                      # the file system's answer names the file already
    except (SafetensorError, RuntimeError, EOFError, OSError) as e:   # torch's zip reader: EINVAL, RuntimeError
        size = os.path.getsize(file) if os.path.exists(file) else 0
        raise RuntimeError(f"checkpoint file {file!r} ({size} bytes) cannot be read: it is truncated or corrupt "
                           f"({type(e).__name__}: {e}). An interrupted save, copy or download? Save the checkpoint "
                           "again, or copy a complete one over it") from e


class CheckpointReader:
    """Name -> lazily sliced tensor over the weight files of one checkpoint (file or folder)."""

    def __init__(self, path: str):
        self.path = path
        self.weight_map: dict[str, str] = {}
        recover(path)                              # a folder a dead save's commit left aside comes back
        if os.path.isfile(path):
            files = [path]
            folder = os.path.dirname(path)
        else:
            if not os.path.isdir(path):
                raise FileNotFoundError(f"checkpoint {path!r} does not exist")
            folder = path
            index = next((os.path.join(path, n) for n in _INDEXES if os.path.exists(os.path.join(path, n))), None)
            if index is not None:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
                missing = [n for n in files if not os.path.exists(os.path.join(path, n))]
                if missing:
                    raise RuntimeError(f"checkpoint {path!r} is incomplete: its index lists {missing} which do not "
                                       "exist (an interrupted copy or save?); use a complete checkpoint")
                files = [os.path.join(path, n) for n in files]
            else:
                files = [os.path.join(path, n) for n in _SINGLES if os.path.exists(os.path.join(path, n))][:1]
            if not files:
                raise FileNotFoundError(f"{path!r} holds no model weights (expected one of {_SINGLES + _INDEXES})")
        self.folder = folder
        self._handles: dict[str, object] = {}
        for file in files:
            for key in self._open(file).keys():
                self.weight_map[key] = file
        self.release()

    def _open(self, file: str):
        if file not in self._handles:
            if file.endswith(".safetensors"):
                from safetensors import safe_open
                self._handles[file] = open_weights(file, lambda: safe_open(file, framework="pt"))
            else:
                self._handles[file] = open_weights(
                    file, lambda: torch.load(file, map_location="cpu", mmap=True, weights_only=True))
        return self._handles[file]

    def release(self) -> None:
        """Drop open file handles (and their memory maps)."""
        self._handles.clear()

    def keys(self) -> set[str]:
        return set(self.weight_map)

    def shape(self, key: str) -> tuple[int, ...]:
        handle = self._open(self.weight_map[key])
        if isinstance(handle, dict):
            return tuple(handle[key].shape)
        return tuple(handle.get_slice(key).get_shape())

    def read(self, key: str, index: tuple | None = None) -> torch.Tensor:
        """The tensor `key`, or only `full[index]` (basic slices) without reading the rest."""
        handle = self._open(self.weight_map[key])
        if isinstance(handle, dict):
            t = handle[key]
            return (t if index is None else t[index]).clone()
        if index is None:
            return handle.get_tensor(key)
        return handle.get_slice(key)[index]


def read_shard(reader: CheckpointReader, key: str, info: TensorParallelInfo | None) -> torch.Tensor:
    """This rank's shard of checkpoint tensor `key` (its tp shard and, for an expert-parallel weight, its
    run of experts; the full tensor for a replicated parameter)."""
    if info is None or info.tp_size == 1 and not info.padding and info.expert_size == 1:
        return reader.read(key)
    return shard_from(lambda index: reader.read(key, index), reader.shape(key), info, f"checkpoint tensor {key!r}")


def _candidates(name: str, prefix: str) -> list[str]:
    out = [name]
    if prefix and name.startswith(prefix + "."):
        out.append(name[len(prefix) + 1:])
    elif prefix:
        out.append(f"{prefix}.{name}")
    return out


def _reinit_meta_buffers(model: nn.Module, device: torch.device) -> None:
    """Recreate buffers left on the meta device (position ids, rotary frequencies) with the model's
    own `_init_weights`, which transformers 5.x uses for exactly these buffers."""
    init = getattr(model, "_init_weights", None)
    for module in model.modules():
        metas = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        if not metas:
            continue
        for n in metas:
            buf = getattr(module, n)
            module._buffers[n] = torch.empty_like(buf, device=device)
        if init is not None:
            init(module)
        still = [n for n in metas if not torch.isfinite(getattr(module, n).float()).all()]
        if still:
            raise RuntimeError(f"could not rebuild buffers {still} of {type(module).__name__} after meta init")




@torch.no_grad()
def load_model(model: nn.Module, checkpoint: str, strict: bool = True, device: torch.device | None = None,
               partial_model: bool = False, rename: Callable[[str], str | None] | None = None) -> None:
    """Load `checkpoint` (an HF folder or file) into `model` in place, at whatever tensor-parallel
    layout `model` has. Parameters on the meta device are materialised on `device`.

    strict: every parameter and persistent buffer must be found, and every checkpoint tensor used
    (buffers transformers itself ignores excepted); otherwise the error lists what differs.
    partial_model: `model` holds only part of the checkpoint (a pipeline stage): tensors it does
    not hold are expected, only missing ones are errors.

    A weight tied to another (GPT-2's lm_head to wte) is stored once, under the name HF keeps
    (`all_tied_weights_keys`); it is found under that name even where a pipeline stage holds only
    the tied copy.

    rename(name): another name to look a tensor up by after its own (a peft model's parameters in a
    checkpoint of its base model); None for a tensor such a checkpoint cannot hold (an adapter),
    which is then left as it is when the checkpoint lacks it, not reported missing.
    """
    reader = CheckpointReader(checkpoint)
    prefix = getattr(model, "base_model_prefix", "") or ""
    keys = reader.keys()
    entries = _model_tensors(model)
    resolved, missing = _find_keys(entries, reader, prefix, rename)
    used = _copy_into_model(reader, resolved, device)
    # the other names of a tied weight count as used
    used |= {c for _, _, names in entries for n in names for c in _candidates(n, prefix) if c in keys}
    unexpected = [] if partial_model else sorted(k for k in keys - used if not _IGNORABLE.search(k))
    if strict and (missing or unexpected):
        raise RuntimeError(f"loading {checkpoint!r}: missing {missing[:20]}{' ...' if len(missing) > 20 else ''}; "
                           f"unexpected {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}. Pass strict=False "
                           "to load the matching tensors only")
    meta_left = [n for n, p in model.named_parameters() if p.is_meta]
    if meta_left:
        raise RuntimeError(f"parameters {meta_left[:10]} are still on the meta device: the checkpoint lacks them")
    if any(b.is_meta for b in model.buffers()):
        _reinit_meta_buffers(model, device or torch.device("cpu"))


def _model_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, list[str]]]:
    """(name, tensor, the checkpoint names it may be stored under) for every parameter, then every
    persistent buffer, of `model`."""
    names = ParamNames(model)
    entries = [(name, p, names.names(p)) for name, p in model.named_parameters()]
    state = model.state_dict(keep_vars=True)
    param_ids = {id(p) for _, p, _ in entries}
    entries += [(n, b, [n]) for n, b in state.items() if id(b) not in param_ids and isinstance(b, torch.Tensor)]
    return entries


def _find_keys(entries: list, reader: CheckpointReader, prefix: str,
               rename: Callable[[str], str | None] | None) -> tuple[list[tuple], list[str]]:
    """(file, checkpoint key, name, tensor) for every model tensor the checkpoint holds, and the names
    of those it lacks (a tensor renamed to None may be absent: it is left as it is)."""
    keys = reader.keys()
    resolved, missing = [], []
    for name, tensor, names in entries:
        alias = rename(name) if rename is not None else name
        lookup = names if alias in (None, name) else [*names, alias]
        key = next((c for n in lookup for c in _candidates(n, prefix) if c in keys), None)
        if key is not None:
            resolved.append((reader.weight_map[key], key, name, tensor))
        elif alias is not None:
            missing.append(name)
    return resolved, missing


def _copy_into_model(reader: CheckpointReader, resolved: list[tuple], device: torch.device | None) -> set[str]:
    """Read this rank's slice of every resolved tensor into its model tensor; returns the keys read.
    File by file, releasing each file's mapping before the next: the file-backed pages a rank maps
    stay bounded by one weights file."""
    used: set[str] = set()
    current_file = None
    for file, key, name, tensor in sorted(resolved, key=lambda r: r[0]):
        if file != current_file:
            reader.release()
            current_file = file
        used.add(key)
        _copy_shard(tensor, read_shard(reader, key, get_tp_info(tensor)), name, device)
    reader.release()
    return used


def _check_nf4(tensor: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """A frozen NF4 base (QLoRA) loads only the values it already computes with: quantizing other values again
    would change them (and quantizing these again would too), so anything else is refused."""
    if is_dtensor(tensor):             # FSDP2: this rank's rows of the value against its NF4 rows
        from torch.distributed.tensor import distribute_tensor
        mesh = tensor.device_mesh
        value = distribute_tensor(value.to(mesh.device_type), mesh, tensor.placements, src_data_rank=None).to_local()
        tensor = tensor.to_local()
    if not torch.equal(dequantized(tensor), value.to(tensor.device)):
        raise ValueError(f"{name} is a frozen NF4 base (QLoRA) whose 4-bit values differ from the checkpoint's; "
                         "quantizing the checkpoint's values would not give them back exactly. Quantize the same base "
                         "weights the checkpoint was trained on, or load it into the unquantized model")


def _copy_shard(tensor: torch.Tensor, shard: torch.Tensor, name: str, device: torch.device | None) -> None:
    """Put `shard` into `tensor`: materialised from the meta device on `device`, into a DTensor's
    local piece, or copied in place."""
    if shard.shape != tensor.shape:
        raise ValueError(f"{name}: checkpoint slice has shape {tuple(shard.shape)}, parameter has "
                         f"{tuple(tensor.shape)}")
    target_device = device if tensor.is_meta else tensor.device
    if tensor.is_meta and target_device is None:
        raise ValueError("the model is on the meta device: pass device= to materialise it")
    value = shard.to(device=target_device, dtype=tensor.dtype)
    if value.data_ptr() == shard.data_ptr():
        # safetensors and mmap'ed pickles hand out file-backed memory: own it, so the model
        # never depends on the file (and memory figures are honest).
        value = value.clone()
    if is_nf4(tensor.to_local() if is_dtensor(tensor) else tensor):
        _check_nf4(tensor, value, name)
    elif tensor.is_meta:
        replace_keeping_object(tensor, value)
    elif is_dtensor(tensor):
        # torch FSDP2 (GeminiPlugin, TorchFSDPPlugin): each rank cuts its own piece, no communication
        from torch.distributed.tensor import distribute_tensor
        mesh = tensor.device_mesh
        tensor.to_local().copy_(distribute_tensor(value.to(mesh.device_type), mesh, tensor.placements,
                                                  src_data_rank=None).to_local())
    else:
        tensor.copy_(value)
