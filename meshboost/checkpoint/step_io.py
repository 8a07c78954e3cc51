"""Training checkpoints: one step folder with everything a run needs to resume, committed by an
atomic pointer update.

Layout of a checkpoint folder:
    step-00000010/    model/, optimizer/, lr_scheduler.pt (whatever the caller's parts write),
                      ranks/rank-00000.pt ... (each rank's RNG states; the state of a data loader
                      that has no global position),
                      meta.json (written last: step, world size, mesh, the data loader's global
                      sample position, the caller's extras, and "files": every other file's size
                      and crc32, checked before a load: `manifest.py`)
    latest            "step-00000010": the committed step, replaced atomically (os.replace)
    .step-00000012.tmp-<token>/   a save in progress; removed when it fails, or by the next save
    .lock             held (flock) by the save in progress, naming it: a second save is refused, and
                      only the holder cleans what dead saves left (`atomic.SaveLock`)
Saving: every rank writes into one staging folder (the parts through their own writers, then its
rank file), each file fsynced, all agree, global rank 0 writes meta.json, renames the folder to
its step name and replaces `latest`; only then does it delete committed steps beyond `keep_last`.
A crash at any point leaves `latest` naming a complete step. An asynchronous save (`saver`,
`async_save.AsyncSaver`) runs the same steps, but its writers stage their files in host memory
(`file_log.FileLog(defer=True)`) and a thread writes them, agrees and commits (`_finish`). Loading reads `latest` (or, without it, the newest
step holding meta.json); every rank agrees on the step and finds its files before anything is
loaded (`open_step`). Needs a file system every rank shares. Must not know what the parts are.
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import secrets
import shutil
import warnings
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from meshboost.checkpoint.atomic import SaveLock, clean_leftovers, recover, replace_folder
from meshboost.checkpoint.file_log import FileLog, fsync_dir, recording
from meshboost.checkpoint.manifest import MANIFEST, manifest_of, verify_step
from meshboost.checkpoint.writer import agree, any_failed, raise_agreed_failure, save_roles
from meshboost.distributed import comm
from meshboost.distributed.agreement import agree_settings

FORMAT = "meshboost-step-v1"
POINTER = "latest"
LOCK = ".lock"          # inside the folder: held by the save in progress (atomic.SaveLock)
_STEP = re.compile(r"^step-(\d{8})$")
_LEFTOVER = re.compile(r"^\.(step-\d{8}|latest)\.(tmp|old)-")   # what a dead save can leave (atomic.py)


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
    the folder holds no complete step. A committed step that a save re-saving it moved aside and
    died before renaming the new one in (file systems without an atomic exchange) is put back
    first, unless that save is still running (`atomic.SaveInProgress`)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"checkpoint folder {folder!r} is a file; pass the folder save_checkpoint wrote")
    name = _pointer(folder)
    if name is not None and _STEP.match(name):
        recover(os.path.join(folder, name), lock_file=os.path.join(folder, LOCK))
    return _committed(folder)


def _pointer(folder: str) -> str | None:
    pointer = os.path.join(folder, POINTER)
    if not os.path.isfile(pointer):
        return None
    with open(pointer, encoding="utf-8") as fh:
        return fh.read().strip()


def _committed(folder: str) -> str | None:
    """committed_step without the recovery (the save holding the lock has recovered already)."""
    name = _pointer(folder)
    if name is not None:
        if _STEP.match(name) and os.path.isfile(os.path.join(folder, name, "meta.json")):
            return os.path.join(folder, name)
        raise RuntimeError(f"checkpoint folder {folder!r}: {POINTER} names {name!r}, which is not a complete step; "
                           "restore the folder or point it at another step-* folder")
    if not os.path.isdir(folder):
        return None
    steps = sorted(n for n in os.listdir(folder)
                   if _STEP.match(n) and os.path.isfile(os.path.join(folder, n, "meta.json")))
    return os.path.join(folder, steps[-1]) if steps else None


def _prepare(folder: str, name: str) -> SaveLock:
    """Rank 0, before a save: the folder exists and this save holds its lock (returned: released
    by save_step after the commit or the abort; `atomic.SaveInProgress` naming the holder while
    another live save has it); then, and only then, what dead saves left is cleaned: staging
    folders and pointer files removed, a committed step moved aside by a dead commit put back."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"checkpoint folder {folder!r} is a file; pass a folder path (save_checkpoint writes a "
                         "folder of step-* folders and a 'latest' pointer)")
    os.makedirs(folder, exist_ok=True)
    lock = SaveLock(os.path.join(folder, LOCK), folder).acquire()
    try:
        for base in sorted({m.group(1) for m in map(_LEFTOVER.match, os.listdir(folder)) if m}):
            clean_leftovers(os.path.join(folder, base))
    except BaseException:
        lock.release()
        raise
    return lock


def _release(lock: SaveLock | None) -> None:
    if lock is not None:
        lock.release()


def _commit(folder: str, staging: str, name: str, meta: dict, keep_last: int) -> None:
    """Rank 0: meta.json last inside the step (durable, like every file the manifest names), the step
    in place, the pointer replaced, old steps pruned."""
    with open(os.path.join(staging, "meta.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    final = os.path.join(folder, name)
    pointed = _committed(folder)
    if os.path.exists(final) and (pointed is None or os.path.abspath(pointed) != os.path.abspath(final)):
        shutil.rmtree(final)                           # an uncommitted leftover of a save that died
    if os.path.exists(final):                          # the committed step saved again under its own name:
        replace_folder(staging, final)                 # one exchange, or moved aside (recovered after a crash)
    else:
        os.replace(staging, final)
    fsync_dir(folder)
    tmp = os.path.join(folder, f".{POINTER}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, os.path.join(folder, POINTER))    # the commit
    fsync_dir(folder)
    steps = sorted(n for n in os.listdir(folder) if _STEP.match(n) and n <= name)
    for old_step in steps[:-keep_last]:
        shutil.rmtree(os.path.join(folder, old_step), ignore_errors=True)


def save_step(folder: str, step: int, parts: dict[str, Callable[[str], None]], rank_state: dict, mesh=None,
              keep_last: int = 3, extra: dict | None = None, data: dict | None = None, saver=None,
              if_busy: str = "wait") -> str | None:
    """Write step `step` into checkpoint folder `folder`; call on every rank. `parts`: name ->
    save(path) (collective: every rank calls each, in this order); `rank_state`: this rank's own
    state (RNG), one file per rank; `data`: the data loader's global position (JSON-able, equal on
    every rank), kept in meta.json so that any layout can resume from it. Returns the step folder
    (committed; with `saver`, committed once its write in the background is).

    saver (`async_save.AsyncSaver`): stage the step in host memory now, write and commit it in the
    saver's thread. A save still in flight is waited for (if_busy="wait") or this step is skipped
    on every rank with a warning (if_busy="skip": returns None); its failure raises here."""
    # A script that counts steps per rank would commit a step without some ranks' state (they staged
    # elsewhere): agree first, naming each rank's value (before the checks below too, so a bad value
    # on one rank cannot leave the others waiting).
    agree_settings({"step": step, "keep_last": keep_last, "data position": data, "asynchronous": saver is not None,
                    "if_busy": if_busy}, f"save_checkpoint({folder!r}) arguments")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step={step!r} must be a non-negative integer (the training step just finished)")
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last={keep_last!r} must be a positive integer (how many steps to keep)")
    if if_busy not in ("wait", "skip"):
        raise ValueError(f"if_busy={if_busy!r} must be 'wait' (for the save in flight) or 'skip' (this step)")
    roles = save_roles(mesh)
    if saver is not None:
        if if_busy == "skip" and agree([float(saver.busy)], roles)[0]:     # the same answer on every rank
            warnings.warn(f"save_checkpoint({folder!r}, step={step}) skipped: the previous asynchronous save is "
                          "still being written (if_busy='skip'; if_busy='wait' waits for it)", stacklevel=3)
            return None
        saver.wait()                                   # its failure raises on every rank (agreed in its thread)
        writer_roles = saver.roles_for(roles)          # the threads' own group: created here, on every rank
    name, lock, staging = _stage_folder(folder, step, roles)
    log = FileLog(staging, defer=saver is not None, buffers=saver.buffers if saver is not None else None)
    error = None
    try:
        with recording(log):
            for part, save in parts.items():
                save(os.path.join(staging, part))      # each agrees on its own failure
    except BaseException:
        _abandon(staging, lock, roles)
        agree([0.0], roles)                            # nobody returns before the staging folder is gone
        raise
    rank = torch.distributed.get_rank() if roles.group is not None else 0
    try:
        os.makedirs(os.path.join(staging, "ranks"), exist_ok=True)
        log.write(torch.save, rank_state, os.path.join(staging, "ranks", f"rank-{rank:05d}.pt"), defer=False)
        log.staged()
    except Exception as e:  # noqa: BLE001
        error = e
    if any_failed(error, roles):
        _abandon(staging, lock, roles)
        raise_agreed_failure(error, roles, f"save_checkpoint({folder!r})")
    world = torch.distributed.get_world_size() if roles.group is not None else 1
    layout = {"dp": mesh.dp_size, "pp": mesh.pp_size, "tp": mesh.tp_size} if mesh is not None else None
    meta = {"format": FORMAT, "step": step, "world_size": world, "mesh": layout, "parts": list(parts),
            "extra": extra or {}, "data": data}
    finish = functools.partial(_finish, folder, staging, name, meta, keep_last, log, lock)
    if saver is None:
        finish(roles)
    else:
        saver.report(step, rank)
        saver.start(lambda: finish(writer_roles), f"save_checkpoint({folder!r}, step={step})")
    return os.path.join(folder, name)


def _stage_folder(folder: str, step: int, roles) -> tuple[str, SaveLock | None, str]:
    """(step name, the save lock (rank 0), the staging folder every rank writes into): rank 0 takes the
    lock and cleans what dead saves left; every rank agrees on the folder's token (or on the failure)."""
    name, error, lock = step_name(step), None, None
    if roles.main_writer:
        try:
            lock = _prepare(folder, name)              # held until the commit or the abort
        except Exception as e:  # noqa: BLE001 - agreed just below
            error = e
    token, failed = agree([float(secrets.randbits(48)) if roles.main_writer else 0.0,
                           float(error is not None)], roles)
    if failed:
        raise_agreed_failure(error, roles, f"save_checkpoint({folder!r})")
    return name, lock, os.path.join(folder, f".{name}.tmp-{int(token):012x}")


def _abandon(staging: str, lock: SaveLock | None, roles) -> None:
    if roles.main_writer:
        shutil.rmtree(staging, ignore_errors=True)
    _release(lock)


def _gather(value, roles) -> list:
    """`value` of every rank (one all_gather_object over `roles.group`; also a barrier)."""
    if roles.group is None:
        return [value]
    out = [None] * torch.distributed.get_world_size(roles.group)
    torch.distributed.all_gather_object(out, value, group=roles.group)
    return out


def _finish(folder: str, staging: str, name: str, meta: dict, keep_last: int, log: FileLog, lock, roles) -> None:
    """Every rank, once the step is staged: write what `log` deferred (each file fsynced), agree that
    every rank's files are durable, let rank 0 commit with the manifest of every file, agree on that.
    On any failure the staging folder goes, the lock is released, and every rank raises (the failing
    one its own error, the others one quoting it). Runs in the saver's thread for an asynchronous
    save: over `roles.group`, which then is the threads' own (no other collective uses it)."""
    error = None
    try:
        log.flush()
    except Exception as e:  # noqa: BLE001 - agreed just below
        error = e
    reports = _gather((log.entries(), None if error is None else f"{type(error).__name__}: {error}"), roles)
    if roles.main_writer and all(message is None for _, message in reports):
        try:
            files = manifest_of(staging, [entries for entries, _ in reports])
            _commit(folder, staging, name, {**meta, MANIFEST: files}, keep_last)
        except Exception as e:  # noqa: BLE001
            error = e
    messages = _gather(None if error is None else f"{type(error).__name__}: {error}", roles)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        _abandon(staging, lock, roles)
        if error is not None:
            raise error
        raise RuntimeError(f"save_checkpoint({folder!r}) failed on rank {failed[0][0]}: {failed[0][1]}. The steps "
                           "committed before are unchanged.")
    _release(lock)


@dataclass
class StepToLoad:
    """A committed step every rank has agreed on, checked before anything is loaded."""

    folder: str                 # the step folder
    meta: dict                  # its meta.json
    rank_state: dict | None     # this rank's RNG states; None when another layout saved the step


def open_step(folder: str, parts: list[str], mesh=None, verify: bool = True) -> StepToLoad | None:
    """Call on every rank before loading anything: the committed step of `folder`, its meta and this
    rank's own state. Any rank that finds a file missing or unreadable (meta.json, one of `parts` the
    caller will load, its `ranks/rank-N.pt`) fails every rank at once, naming the file, so no rank
    walks into the next collective while another has died; ranks that see different committed steps
    (a folder that is not one shared file system, or a save committing meanwhile) are refused too.
    None on every rank when no step is committed yet. verify: every file those parts and the rank
    files need is checked against the step's manifest (size, crc32) first, the files dealt out over
    the ranks; a damaged one fails every rank, naming it."""
    result: list[StepToLoad | None] = []

    def find() -> None:
        step_folder = committed_step(folder)
        result.append(None if step_folder is None else _read_step(step_folder, parts, mesh))
    agreed(find, mesh, f"load_checkpoint({folder!r})")
    found, roles = result[0], save_roles(mesh)
    if roles.group is not None:
        step = torch.tensor([found.meta["step"] if found is not None else -1], dtype=torch.int64, device=roles.device)
        seen = comm.all_gather(step, roles.group, dim=0).tolist()
        if len(set(seen)) > 1:
            views = ", ".join(f"{step_name(v) if v >= 0 else 'none'} on rank {r}" for r, v in enumerate(seen))
            raise RuntimeError(f"ranks see different committed steps in {folder!r} ({views}): every rank must read "
                               "one file system that all of them share, and no save may commit while they load")
    if found is not None and verify:
        rank, world = (torch.distributed.get_rank(roles.group), torch.distributed.get_world_size(roles.group)) \
            if roles.group is not None else (0, 1)
        agreed(lambda: verify_step(found.folder, found.meta, parts, rank, world), mesh,
               f"load_checkpoint({folder!r})")
    return found


def agreed(load: Callable[[], None], mesh, what: str) -> None:
    """Run `load` (which must not communicate) on every rank; a failure on any rank raises on every
    rank, the failing one its own error, the others one quoting it."""
    roles, error = save_roles(mesh), None
    try:
        load()
    except Exception as e:  # noqa: BLE001 - agreed just below
        error = e
    if any_failed(error, roles):
        raise_agreed_failure(error, roles, what)


def _read_step(step_folder: str, parts: list[str], mesh) -> StepToLoad:
    meta = read_meta(step_folder)
    for part in parts:
        if part in meta["parts"] and not os.path.exists(os.path.join(step_folder, part)):
            raise FileNotFoundError(f"checkpoint step {step_folder!r} lists {part!r} but it is missing: the step is "
                                    "incomplete; restore it or point 'latest' at another step")
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    layout = {"dp": mesh.dp_size, "pp": mesh.pp_size, "tp": mesh.tp_size} if mesh is not None else None
    if meta["world_size"] != world or meta["mesh"] != layout:
        data = ("the data position is restored from the global sample count" if meta.get("data") else
                "nor is the data-loader position (this checkpoint has no global sample count)")
        warnings.warn(f"{step_folder} was saved by {meta['world_size']} ranks as {meta['mesh']}; this run is {world} "
                      f"ranks as {layout}: model, optimizer and scheduler are restored, the random generators are "
                      f"not (each rank kept its own); {data}", stacklevel=4)
        return StepToLoad(step_folder, meta, None)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    path = os.path.join(step_folder, "ranks", f"rank-{rank:05d}.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint step {step_folder!r} has no state file for rank {rank} ({path!r}; it "
                                f"was saved by {meta['world_size']} ranks): restore the file or point 'latest' at "
                                "another step")
    try:
        rank_state = torch.load(path, weights_only=True)
    except Exception as e:  # a truncated or foreign file: name it
        raise RuntimeError(f"cannot read rank {rank}'s state file {path!r} ({type(e).__name__}: {e}): restore the "
                           "file or point 'latest' at another step") from e
    return StepToLoad(step_folder, meta, rank_state)


def read_meta(step_folder: str) -> dict:
    path = os.path.join(step_folder, "meta.json")
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise RuntimeError(f"cannot read {path!r} ({type(e).__name__}: {e}): the step is damaged; restore it or "
                           "point 'latest' at another step") from e
