"""The checkpoint half of the Booster API: from boosted objects to `meshboost.checkpoint` calls.

Owns: finding what a boosted object carries (the user's model inside its wrappers, the optimizer
`Booster.boost` paired with it, its fp32 masters), calling `checkpoint/` with the plugin's mesh,
refreshing an optimizer's fp32 masters after its model was loaded, and what a training checkpoint
(`save_checkpoint` / `load_checkpoint`) holds, and what a weight export is given. Must not gather tensors or write files itself.
"""

from __future__ import annotations

import os

import torch.nn as nn

from meshboost.booster import lora
from meshboost.booster.dataloader import ResumableDataLoader
from meshboost.booster.wrappers import ModelWrapper, unwrap_model
from meshboost.checkpoint import export, export_entries, load_lr_scheduler, load_model, optimizer_io, save_lr_scheduler
from meshboost.checkpoint import save_model, step_io
from meshboost.distributed.launch import get_current_device
from meshboost.optim import OptimizerWrapper


def _optimizer_of(model: nn.Module) -> OptimizerWrapper | None:
    return model.boosted_optimizer if isinstance(model, ModelWrapper) else None


def save_boosted_model(model: nn.Module, checkpoint: str, mesh=None, **kwargs) -> None:
    """Save boosted (or plain) `model`; the fp32 masters of the optimizer boosted with it are saved
    in place of rounded half-precision weights."""
    optimizer = _optimizer_of(model)
    masters = optimizer.master_weight if optimizer is not None and optimizer.keeps_masters else None
    save_model(unwrap_model(model), checkpoint, mesh, master_weight=masters, **kwargs)


def export_boosted_weights(model: nn.Module, mesh=None, state=None, lora_mode: str = "merged", **kwargs):
    """`checkpoint.export.export_weights` of boosted (or plain) `model`: the values `save_boosted_model`
    writes (the fp32 masters of the optimizer boosted with it), a LoRA model's base weights under the base
    model's HF names."""
    optimizer = _optimizer_of(model)
    masters = optimizer.master_weight if optimizer is not None and optimizer.keeps_masters else None
    inner = unwrap_model(model)
    entries = export_entries.entries_of(inner, lora_mode, rename=lora.base_checkpoint_name)
    if state is not None and masters is not None and kwargs.get("dtype") is not None:
        wider = [e.name for e in entries if e.dtype.is_floating_point and e.dtype.itemsize < kwargs["dtype"].itemsize]
        if wider:
            raise NotImplementedError(f"export_weights(delta=True, dtype={kwargs['dtype']}): {wider[0]} is held in "
                                      "a narrower dtype apart from its fp32 master, so an unchanged weight may hide "
                                      "a changed master; export in the working dtype (dtype=None) or without delta")
    return export.export_weights(inner, entries, mesh, master_weight=masters, state=state, **kwargs)


def load_boosted_model(model: nn.Module, checkpoint: str, strict: bool = True, mesh=None) -> None:
    """Load an HF folder/file into boosted `model` in place (any layout; only owned slices are read;
    a meta-device model is materialised on the mesh's device). With pipeline stages a stage holds
    part of the model, so checkpoint tensors of other stages are expected and skipped. The
    optimizer boosted with `model` gets its fp32 masters refreshed from the loaded weights. A LoRA
    model loads a checkpoint of its base model (its adapters keep their values) or one of itself."""
    _load_weights(model, checkpoint, strict, mesh)
    _sync_masters(model)


def _load_weights(model: nn.Module, checkpoint: str, strict: bool, mesh) -> None:
    """The weights only (no communication: every rank reads its own slices)."""
    staged = mesh is not None and mesh.pp_size > 1
    device = mesh.device if mesh is not None else get_current_device()
    inner = unwrap_model(model)
    # a LoRA model (booster.enable_lora) reads its base weights from the base model's HF checkpoint
    rename = lora.base_checkpoint_name if lora.is_peft_model(inner) else None
    load_model(inner, checkpoint, strict=strict, device=device, partial_model=staged, rename=rename)


def _sync_masters(model: nn.Module) -> None:
    optimizer = _optimizer_of(model)
    if optimizer is not None:
        optimizer.sync_masters_from_model()


def _model_of(optimizer, what: str) -> nn.Module:
    model = optimizer.boosted_model if isinstance(optimizer, OptimizerWrapper) else None
    if model is None:
        raise TypeError(f"{what} needs the optimizer returned by booster.boost(model, optimizer), with the boosted "
                        "model still referenced (the optimizer holds it weakly, so a dropped model is freed): its "
                        "states are keyed by the names of the model it was boosted with")
    return unwrap_model(model)


def save_boosted_optimizer(optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                           prefix: str | None = None, size_per_shard: int = 1024, mesh=None) -> None:
    if not gather_dtensor:
        raise NotImplementedError("save_optimizer(gather_dtensor=False) (per-rank shard files) is not supported; "
                                  "use gather_dtensor=True: the full-tensor checkpoint loads at any layout")
    optimizer_io.save_optimizer(optimizer, _model_of(optimizer, "save_optimizer"), checkpoint, shard=shard,
                                size_per_shard=size_per_shard, prefix=prefix, mesh=mesh)


def load_boosted_optimizer(optimizer, checkpoint: str) -> None:
    optimizer_io.load_optimizer(optimizer, _model_of(optimizer, "load_optimizer"), checkpoint)


# -- training checkpoints: everything a run needs to resume, one atomically committed step ----------
def save_checkpoint(folder: str, step: int, model: nn.Module, optimizer=None, lr_scheduler=None, dataloader=None,
                    mesh=None, keep_last: int = 3, extra: dict | None = None, saver=None,
                    if_busy: str = "wait") -> str | None:
    """Model (HF folder), optimizer (name-keyed, with its loss scaler), LR scheduler, every rank's
    RNG states and the data-loader position as step `step` of `folder` (see
    `meshboost.checkpoint.step_io`; `saver`: written in its background thread). Returns the step
    folder (None: skipped, a save still in flight and if_busy="skip")."""
    parts = {"model": lambda path: save_boosted_model(model, path, mesh, shard=True, use_safetensors=True)}
    if optimizer is not None:
        parts["optimizer"] = lambda path: save_boosted_optimizer(optimizer, path, shard=True, mesh=mesh)
    if lr_scheduler is not None:
        parts["lr_scheduler.pt"] = lambda path: save_lr_scheduler(lr_scheduler, path, mesh)
    # prepare_dataloader's loader has a global sample position (any layout resumes from it); another
    # loader's own state_dict is per rank (restored at the same layout only)
    data = dataloader.state_dict() if isinstance(dataloader, ResumableDataLoader) else None
    rank_state = {"rng": step_io.rng_state(),
                  "dataloader": dataloader.state_dict() if data is None and hasattr(dataloader, "state_dict")
                  else None}
    return step_io.save_step(folder, step, parts, rank_state, mesh, keep_last, extra, data=data, saver=saver,
                             if_busy=if_busy)


def load_checkpoint(folder: str, model: nn.Module, optimizer=None, lr_scheduler=None, dataloader=None,
                    mesh=None, verify: bool = True) -> dict | None:
    """Restore the committed step of `folder`: weights, optimizer, scheduler and the data position at
    any layout (the position of `plugin.prepare_dataloader`'s loader is global), RNG states when the
    mesh is the one that saved. Every rank agrees on the step and finds its files first. Returns its
    meta ({"step", "extra", ...}), or None when `folder` holds no checkpoint yet (a fresh run)."""
    wanted = ["model"] + (["optimizer"] if optimizer is not None else []) + \
        (["lr_scheduler.pt"] if lr_scheduler is not None else [])
    found = step_io.open_step(folder, wanted, mesh, verify=verify)   # verify: the files' sizes and checksums
    if found is None:
        return None
    step_folder, meta = found.folder, found.meta
    # a weight file one rank cannot read fails every rank here, not at the next collective
    step_io.agreed(lambda: _load_weights(model, os.path.join(step_folder, "model"), True, mesh), mesh,
                   f"load_checkpoint({folder!r})")
    _sync_masters(model)
    if optimizer is not None and "optimizer" in meta["parts"]:
        load_boosted_optimizer(optimizer, os.path.join(step_folder, "optimizer"))
    if lr_scheduler is not None and "lr_scheduler.pt" in meta["parts"]:
        load_lr_scheduler(lr_scheduler, os.path.join(step_folder, "lr_scheduler.pt"))
    if found.rank_state is not None:
        step_io.set_rng_state(found.rank_state["rng"])
    if dataloader is not None and hasattr(dataloader, "load_state_dict"):
        if meta.get("data") is not None and isinstance(dataloader, ResumableDataLoader):
            dataloader.load_state_dict(meta["data"])
        elif found.rank_state is not None and found.rank_state["dataloader"] is not None:
            dataloader.load_state_dict(found.rank_state["dataloader"])
    return meta
