"""Training checkpoints: one step folder with everything a run needs to resume, committed by an
atomic pointer update.

Layout of a checkpoint folder:
    step-00000010/    model/, optimizer/, lr_scheduler.pt (whatever the caller's parts write),
                      ranks/rank-00000.pt ... (each rank's RNG states and data-loader position),
                      meta.json (written last: step, world size, mesh, the caller's extras)
    latest            "step-00000010": the committed step, replaced atomically (os.replace)
    .step-00000012.tmp-<token>/   a save in progress; removed when it fails, or by the next save
Saving: every rank writes into one staging folder (the parts through their own writers, then its
rank file), all agree, global rank 0 writes meta.json, renames the folder to its step name and
replaces `latest`; only then does it delete committed steps beyond `keep_last`. A crash at any
point leaves `latest` naming a complete step. Loading reads `latest` (or, without it, the newest
step holding meta.json). Needs a file system every rank shares. Must not know what the parts are.
"""

from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import warnings
from typing import Callable

import numpy as np
import torch

from meshboost.checkpoint.atomic import exchange
from meshboost.checkpoint.writer import agree, any_failed, raise_agreed_failure, save_roles

FORMAT = "meshboost-step-v1"
POINTER = "latest"
_STEP = re.compile(r"^step-(\d{8})$")


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def rng_state() -> dict:
    """This process's random generators (Python, NumPy, torch CPU and CUDA), in a form
    torch.load(weights_only=True) reads back."""
    version, keys, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": (version, list(keys), gauss), "torch": torch.get_rng_state(),
             "numpy": (name, torch.from_numpy(np_keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    name, np_keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np_keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def committed_step(folder: str) -> str | None:
    """The step folder `latest` names, or (no pointer) the newest one holding meta.json; None when
    the folder holds no complete step."""
    pointer = os.path.join(folder, POINTER)
    if os.path.isfile(pointer):
        with open(pointer, encoding="utf-8") as fh:
            name = fh.read().strip()
        if _STEP.match(name) and os.path.isfile(os.path.join(folder, name, "meta.json")):
            return os.path.join(folder, name)
        raise RuntimeError(f"checkpoint folder {folder!r}: {POINTER} names {name!r}, which is not a complete step; "
                           "restore the folder or point it at another step-* folder")
    if not os.path.isdir(folder):
        return None
    steps = sorted(n for n in os.listdir(folder)
                   if _STEP.match(n) and os.path.isfile(os.path.join(folder, n, "meta.json")))
    return os.path.join(folder, steps[-1]) if steps else None


def _prepare(folder: str, name: str) -> None:
    """Rank 0, before a save: the folder exists; staging folders of saves that died are removed."""
    os.makedirs(folder, exist_ok=True)
    for entry in os.listdir(folder):
        if entry.startswith(".step-") and ".tmp-" in entry:
            shutil.rmtree(os.path.join(folder, entry), ignore_errors=True)


def _commit(folder: str, staging: str, name: str, meta: dict, keep_last: int) -> None:
    """Rank 0: meta.json last inside the step, the step in place, the pointer replaced, old steps pruned."""
    with open(os.path.join(staging, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, sort_keys=True)
    final = os.path.join(folder, name)
    pointed = committed_step(folder)
    if os.path.exists(final) and (pointed is None or os.path.abspath(pointed) != os.path.abspath(final)):
        shutil.rmtree(final)                           # an uncommitted leftover of a save that died
    if os.path.exists(final):                          # the committed step saved again under its own name
        if not exchange(staging, final):               # one atomic swap where the file system can
            old = os.path.join(folder, f".{name}.replaced-{secrets.token_hex(4)}")
            os.replace(final, old)
            os.replace(staging, final)
            staging = old
        shutil.rmtree(staging, ignore_errors=True)     # holds the replaced step now
    else:
        os.replace(staging, final)
    tmp = os.path.join(folder, f".{POINTER}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(folder, POINTER))    # the commit
    steps = sorted(n for n in os.listdir(folder) if _STEP.match(n) and n <= name)
    for old_step in steps[:-keep_last]:
        shutil.rmtree(os.path.join(folder, old_step), ignore_errors=True)


def save_step(folder: str, step: int, parts: dict[str, Callable[[str], None]], rank_state: dict, mesh=None,
              keep_last: int = 3, extra: dict | None = None) -> str:
    """Write step `step` into checkpoint folder `folder`; call on every rank. `parts`: name ->
    save(path) (collective: every rank calls each, in this order); `rank_state`: this rank's own
    state (RNG, data position), one file per rank. Returns the committed step folder."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer (the training step just finished)")
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be a positive integer (how many steps to keep)")
    roles = save_roles(mesh)
    name, error = step_name(step), None
    if roles.main_writer:
        try:
            _prepare(folder, name)
        except Exception as e:  # noqa: BLE001 - agreed just below
            error = e
    token, failed = agree([float(secrets.randbits(48)) if roles.main_writer else 0.0,
                           float(error is not None)], roles)
    if failed:
        raise_agreed_failure(error, roles, f"save_checkpoint({folder!r})")
    staging = os.path.join(folder, f".{name}.tmp-{int(token):012x}")
    try:
        for part, save in parts.items():
            save(os.path.join(staging, part))          # each agrees on its own failure
    except BaseException:
        if roles.main_writer:
            shutil.rmtree(staging, ignore_errors=True)
        agree([0.0], roles)                            # nobody returns before the staging folder is gone
        raise
    rank = torch.distributed.get_rank() if roles.group is not None else 0
    try:
        os.makedirs(os.path.join(staging, "ranks"), exist_ok=True)
        torch.save(rank_state, os.path.join(staging, "ranks", f"rank-{rank:05d}.pt"))
    except Exception as e:  # noqa: BLE001
        error = e
    if not any_failed(error, roles) and roles.main_writer:
        world = torch.distributed.get_world_size() if roles.group is not None else 1
        layout = {"dp": mesh.dp_size, "pp": mesh.pp_size, "tp": mesh.tp_size} if mesh is not None else None
        meta = {"format": FORMAT, "step": step, "world_size": world, "mesh": layout, "parts": list(parts),
                "extra": extra or {}}
        try:
            _commit(folder, staging, name, meta, keep_last)
        except Exception as e:  # noqa: BLE001
            error = e
    if any_failed(error, roles):
        if roles.main_writer:
            shutil.rmtree(staging, ignore_errors=True)
        raise_agreed_failure(error, roles, f"save_checkpoint({folder!r})")
    return os.path.join(folder, name)


def load_rank_state(step_folder: str, mesh=None) -> dict | None:
    """This rank's saved state (RNG, data position), or None with a warning when the checkpoint
    was written by another number of ranks or another mesh (weights and optimizer still load)."""
    with open(os.path.join(step_folder, "meta.json"), encoding="utf-8") as fh:
        meta = json.load(fh)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = {"dp": mesh.dp_size, "pp": mesh.pp_size, "tp": mesh.tp_size} if mesh is not None else None
    if meta["world_size"] != world or meta["mesh"] != layout:
        warnings.warn(f"{step_folder} was saved by {meta['world_size']} ranks as {meta['mesh']}; this run is {world} "
                      f"ranks as {layout}: model, optimizer and scheduler are restored, the random generators and "
                      "the data-loader position are not (the run continues from a fresh data order)", stacklevel=3)
        return None
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return torch.load(os.path.join(step_folder, "ranks", f"rank-{rank:05d}.pt"), weights_only=True)


def read_meta(step_folder: str) -> dict:
    with open(os.path.join(step_folder, "meta.json"), encoding="utf-8") as fh:
        return json.load(fh)
