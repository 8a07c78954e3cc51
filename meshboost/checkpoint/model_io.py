"""Save a (possibly sharded) model as a HuggingFace checkpoint that `from_pretrained` loads.

Owns: turning the model's state dict into full, unpadded tensors under the HF parameter names
(`gather_entry`, which the weight export `export.py` shares: tp shards gathered with `gather_tensor`,
which reads each parameter's own record; the fp32 master in place of a rounded half-precision weight,
fetched one tensor at a time so a ZeRO save never holds more than one file's worth), and what an HF folder holds besides weights (index,
config.json). Who writes, staging, numbering and failure agreement are `writer.py`'s; the file
names and formats `hf_format.py`'s. Must not know optimizers: masters come in as a callable.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
import torch.nn as nn

from meshboost.checkpoint import hf_format
from meshboost.checkpoint.writer import CheckpointWriter, save_roles
from meshboost.distributed.param_info import full_on_cpu, gather_tensor, get_tp_info, is_dtensor


def checkpoint_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> local parameter/buffer, in state-dict order; tied tensors kept once (first name),
    as `from_pretrained` re-ties them."""
    entries, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        entries[name] = tensor
    return entries


def gather_entry(tensor: torch.Tensor, roles, master_weight: Callable | None = None,
                 on_cpu: bool = True) -> torch.Tensor | None:
    """The full, unpadded value of one checkpoint entry (its fp32 master where `master_weight` gives one),
    on the ranks that gather (`roles.gathers`), else None. A collective: every rank of the entry's stage
    calls it for the same entries in the same order. Every rank joins the master's gather (ZeRO sends each
    partition to dp rank 0) and FSDP2's all-gather; replica 0 then gathers over tp (and ep). on_cpu: a
    compact CPU tensor the caller may keep (`full_on_cpu`); else on the device, possibly the live tensor
    itself (read it, never write it)."""
    source = master_weight(tensor) if master_weight is not None else None
    source = tensor if source is None else source
    if is_dtensor(source):           # torch FSDP2: every rank of its mesh joins the all-gather
        source = source.detach().to(roles.device).full_tensor()
    if not roles.gathers:
        return None
    if on_cpu:
        return full_on_cpu(source, get_tp_info(tensor), reuse=source is not tensor)
    return gather_tensor(source.detach(), get_tp_info(tensor))


def save_model(model: nn.Module, checkpoint: str, mesh=None, shard: bool = False, gather_dtensor: bool = True,
               prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False,
               master_weight: Callable[[torch.Tensor], torch.Tensor | None] | None = None) -> None:
    """Write `model` (the user's HF model, at its layout over `mesh`) as an HF checkpoint at
    `checkpoint`; call it on every rank of the mesh.

    shard=True: `checkpoint` is a folder with config.json, model-0000k-of-0000N.safetensors (or
    pytorch_model-...bin) files of at most `size_per_shard` MB and the HF index json.
    shard=False: a folder with config.json and one model.safetensors / pytorch_model.bin; or, when
    `checkpoint` ends in .safetensors/.bin/.pt/.pth, just that file (ColossalAI's behaviour); over pipeline
    stages too (each stage's tensors reach global rank 0 through the staging folder, which writes the file).
    `prefix` is prepended to shard file names (the index still finds them). master_weight(param):
    its fp32 master laid out like the parameter on data-parallel replica 0, or None (under ZeRO a
    collective over dp); when given, the files and config.json hold fp32. The target appears only
    once complete; an existing checkpoint there is replaced atomically.
    """
    # -- pure checks: the same answer on every rank, before any collective ----------------------
    if not gather_dtensor:
        raise NotImplementedError("save_model(gather_dtensor=False) (per-rank shard files) is not supported; "
                                  "use gather_dtensor=True to write a full HF checkpoint")
    if not isinstance(size_per_shard, (int, float)) or size_per_shard <= 0:
        raise ValueError(f"size_per_shard={size_per_shard!r} must be a positive number of megabytes")
    if prefix and not shard:
        raise ValueError(f"prefix={prefix!r} names shard files; it only applies with shard=True")
    roles = save_roles(mesh)
    as_file = not shard and str(checkpoint).endswith(hf_format.SINGLE_FILE_SUFFIXES)
    if as_file:
        use_safetensors = str(checkpoint).endswith(".safetensors")

    writer = CheckpointWriter(
        checkpoint, roles, shard=shard, as_file=as_file, size_per_shard_mb=size_per_shard,
        shard_name=lambda k, total: hf_format.shard_name(use_safetensors, prefix, k, total),
        single_name=hf_format.weights_name(use_safetensors), what="save_model",
        write_file=lambda tensors, path: hf_format.write_weights(tensors, path, use_safetensors),
        read_file=lambda path: hf_format.read_weights(path, use_safetensors))
    try:
        for name, tensor in checkpoint_entries(model).items():
            # an asynchronous save stages each tensor straight from the device into its (pinned) host buffer
            full = gather_entry(tensor, roles, master_weight, on_cpu=not writer.defers)
            if full is not None:
                writer.add(name, full, full.numel() * full.element_size())
    except BaseException:
        writer.discard()                          # no staging folder or save lock outlives a raised save
        raise

    def finalize(folder: str, files, extras) -> None:
        if as_file:
            return
        if shard:
            hf_format.write_index(folder, {n: f.name for f in files for n in f.names}, sum(f.nbytes for f in files),
                                  use_safetensors)
        _save_config(model, folder, torch.float32 if master_weight is not None else None)

    writer.finish(finalize=finalize)


def _save_config(model: nn.Module, folder: str, saved_dtype: torch.dtype | None = None) -> None:
    """config.json (and generation_config.json when the model generates), as save_pretrained writes
    them; `dtype` records what the weight files hold (fp32 when masters were saved). The fields are set
    on a copy: the live config is the user's (a model built from it later must equal the other ranks')."""
    config = getattr(model, "config", None)
    if config is None:
        return
    config = copy.deepcopy(config)
    config.architectures = [type(model).__name__]
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if saved_dtype is not None or floating:
        config.dtype = str(saved_dtype or floating[0]).split(".")[1]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(folder)
