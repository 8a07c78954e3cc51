"""The checkpoint half of the Booster API, shared by every plugin: load a model into a boosted
model (refreshing the optimizer's fp32 masters), save/load optimizers and LR schedulers.

Owns: finding the pieces a boosted object carries (the user's model inside its wrappers, the
optimizer `Booster.boost` paired with it, the plugin's mesh) and calling `load.py`,
`optimizer_io.py`; the LR scheduler's state (a small dict rank 0 writes atomically); on a pipeline
stage, the LM head tied to another stage's embedding (read through load.py's reader and slicing).
Must not gather tensors or communicate beyond agreeing on errors.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from meshboost.checkpoint import optimizer_io
from meshboost.checkpoint.hf_format import AtomicTarget
from meshboost.checkpoint.load import load_model as _load_into
from meshboost.checkpoint.model_io import _any_failed, _roles, _unwrap
from meshboost.launch import get_current_device


def load_boosted_model(model: nn.Module, checkpoint: str, strict: bool = True, mesh=None) -> None:
    """Load an HF folder/file into boosted `model` in place (any layout; only owned slices are read;
    a meta-device model is materialised on the current device). With pipeline stages a stage
    holds part of the model, so checkpoint tensors of other stages are expected and skipped.
    The optimizer boosted with `model` gets its fp32 masters refreshed from the loaded weights."""
    inner = _unwrap(model)
    # A stage holds part of the model: the other stages' tensors are expected, missing ones are not.
    staged = mesh is not None and mesh.pp_size > 1
    _load_into(inner, checkpoint, strict=strict, device=get_current_device(), partial_model=staged)
    optimizer = getattr(model, "boosted_optimizer", None)
    sync = getattr(optimizer, "sync_masters_from_model", None)
    if sync is not None:
        sync()


def _model_of(optimizer, what: str) -> nn.Module:
    model = getattr(optimizer, "boosted_model", None)
    if model is None:
        raise TypeError(f"{what} needs the optimizer returned by booster.boost(model, optimizer): its states are "
                        "keyed by the names of the model it was boosted with")
    return model


def save_boosted_optimizer(optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                           prefix: str | None = None, size_per_shard: int = 1024, mesh=None) -> None:
    if not gather_dtensor:
        raise NotImplementedError("save_optimizer(gather_dtensor=False) (per-rank shard files) is not supported; "
                                  "use gather_dtensor=True: the full-tensor checkpoint loads at any layout")
    optimizer_io.save_optimizer(optimizer, _model_of(optimizer, "save_optimizer"), checkpoint, shard=shard,
                                size_per_shard=size_per_shard, prefix=prefix, mesh=mesh)


def load_boosted_optimizer(optimizer, checkpoint: str) -> None:
    optimizer_io.load_optimizer(optimizer, _model_of(optimizer, "load_optimizer"), checkpoint)


# -- lr scheduler ----------------------------------------------------------------------------------
def save_lr_scheduler(lr_scheduler, checkpoint: str, mesh=None) -> None:
    """Rank 0 writes `lr_scheduler.state_dict()` to the file `checkpoint` (atomically); every rank waits."""
    r = _roles(mesh)
    error = None
    if r.main_writer:
        target = None
        try:
            target = AtomicTarget(checkpoint, is_file=True)
            optimizer_io._write_file(lr_scheduler.state_dict(), target.path)
            target.commit()
        except Exception as e:  # noqa: BLE001
            error = e
            if target is not None:
                target.abort()
    if _any_failed(error, r.group):
        if error is not None:
            raise error
        raise RuntimeError(f"save_lr_scheduler({checkpoint!r}) failed on rank 0; see its error")


def load_lr_scheduler(lr_scheduler, checkpoint: str) -> None:
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"lr scheduler checkpoint {checkpoint!r} does not exist")
    lr_scheduler.load_state_dict(torch.load(checkpoint, weights_only=True))
