"""The one checkpoint writer: every save (model, optimizer, LR scheduler) goes through it.

Owns who does what on a save (`SaveRoles`, from the mesh), the staging folder beside the target
(`atomic.py`), writing each shard file as soon as it fills, numbering the files k-of-N across
pipeline stages, merging the stages' parts on global rank 0, agreeing on failure over every rank,
and the atomic commit. Callers only produce (name, payload, bytes) items in the same order on every
rank of a stage (joining their own gathers) and say how a file and the finishing touches (index,
config) are written. Must not gather tensors (the callers do).

Who does what (mesh order dp x pp x tp, tp innermost):
  * the tp ranks of data-parallel replica 0 join the tp gathers (`gathers`; with expert
    parallelism the ep ranks of replica 0 too, each holding other experts); other replicas hold
    the same values and skip them (under ZeRO they still send their partitions to dp rank 0,
    inside the callers);
  * global rank 0 first takes the target's save lock (`atomic.SaveLock`: a second live save of the
    same target is refused on every rank) and alone removes what dead saves left;
  * each stage's (dp 0, tp 0) rank writes that stage's files (`stage_writer`) into one staging
    folder, named by a token rank 0 draws; with pipeline stages this needs a file system every
    writer shares (one node, or a shared mount);
  * global rank 0 (`main_writer`) merges the stages' parts, writes the index and extras, commits; an
    unsharded save over pipeline stages (ColossalAI's one consolidated file) has each stage stage its
    tensors in a part file, which rank 0 reads back (`read_file`) and writes as the one file;
  * every rank joins the agreements, so a failed write raises on every rank, nobody returns before
    the staging folder is gone, and a checkpoint already at the target is never touched;
  * inside a training-checkpoint step (`file_log.recording`) every file goes through the step's
    `FileLog`: fsynced and checksummed, or (an asynchronous save) each item staged in host memory
    as it is added and the file written later by the save's thread, the log following the renames.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from meshboost.checkpoint import file_log
from meshboost.checkpoint.atomic import AtomicTarget
from meshboost.distributed import comm
from meshboost.distributed.launch import get_current_device


@dataclass
class SaveRoles:
    gathers: bool          # joins the tp gathers of its stage (data-parallel replica 0)
    stage_writer: bool     # writes its stage's files (dp 0, tp 0 of the stage)
    main_writer: bool      # global rank 0: merge, index, extras, commit
    stage: int
    num_stages: int
    group: object          # every rank: agreements run over it (None without a process group)
    device: torch.device   # where the agreement tensors live


def save_roles(mesh=None, main_only: bool = False) -> SaveRoles:
    """The roles of this rank on a save over `mesh` (None: one replicated model, rank 0 writes).
    main_only: a small state only global rank 0 writes (an LR scheduler)."""
    if mesh is None:
        initialized = dist.is_initialized()
        rank = dist.get_rank() if initialized else 0
        roles = SaveRoles(True, rank == 0, rank == 0, 0, 1, dist.group.WORLD if initialized else None,
                          get_current_device())
    else:
        # replica 0 of the experts (edp 0: the ep ranks of dp replica 0, which hold the other experts) joins
        # the gathers; without expert parallelism that is dp replica 0
        # context parallelism: the cp ranks hold the same weights; only cp rank 0 gathers and writes
        first = getattr(mesh, "cp_rank", 0) == 0
        roles = SaveRoles(mesh.edp_rank == 0 and first, mesh.dp_rank == 0 and mesh.tp_rank == 0 and first,
                          mesh.global_rank == 0,
                          mesh.pp_rank, mesh.pp_size, mesh.world_group, mesh.device)
    if main_only:
        roles.stage_writer, roles.stage, roles.num_stages = roles.main_writer, 0, 1
    return roles


def agree(values: list[float], roles: SaveRoles) -> list[float]:
    """Sum `values` over every rank (one all-reduce; also a barrier)."""
    t = torch.tensor(values, dtype=torch.float64, device=roles.device)
    if roles.group is not None:
        comm.all_reduce(t, roles.group)
    return t.tolist()


def starts_new_file(file_bytes: int, file_empty: bool, nbytes: int, limit: float) -> bool:
    """The grouping rule of sharded files: an item opens a new file when the current one holds
    something and the item would take it over `limit` bytes (a larger item gets a file of its own)."""
    return not file_empty and file_bytes + nbytes > limit


@dataclass
class WrittenFile:
    """One file of a checkpoint: its name inside the folder, the items it holds and their bytes."""

    name: str
    names: list
    nbytes: int


class CheckpointWriter:
    """One save at `checkpoint`, on every rank of `roles`.

    shard: items go into files of at most `size_per_shard_mb` MB, named `shard_name(k, total)`;
    otherwise into one file (`single_name` inside the folder, or the target itself when `as_file`).
    write_file(payload: {name: item}, path) writes one file; read_file(path) reads one back (needed for an
    unsharded save over pipeline stages: rank 0 merges the stages' parts). On the stage writer, `add` items
    in order; then every rank calls `finish`.
    """

    def __init__(self, checkpoint: str, roles: SaveRoles, *, shard: bool, as_file: bool = False,
                 size_per_shard_mb: float = 1024, shard_name: Callable[[int, int], str] | None = None,
                 single_name: str | None = None, write_file: Callable[[dict, str], None],
                 read_file: Callable[[str], dict] | None = None, what: str = "save"):
        if not shard and roles.num_stages > 1 and read_file is None:
            raise NotImplementedError(f"{what}(shard=False) with pp_size={roles.num_stages}: each pipeline stage "
                                      "writes its own files; use shard=True")
        self.checkpoint, self.roles, self.what, self.read_file = checkpoint, roles, what, read_file
        self.shard, self.as_file, self.limit = shard, as_file, size_per_shard_mb * 1024 * 1024
        self.shard_name, self.single_name, self.write_file = shard_name, single_name, write_file
        self.error: BaseException | None = None
        self.log = file_log.current()        # a training-checkpoint step records (or defers) what it writes
        self.target: AtomicTarget | None = None
        self.parts: list[WrittenFile] = []
        self._pending: dict = {}
        self._pending_bytes = 0
        # Global rank 0 takes the target's save lock (refused while another live save holds it) and
        # removes what dead saves left, before any other writer touches the folder; then every rank
        # agrees that it did (a refusal raises on every rank before anything is written) and on the
        # token naming the staging folder that every pipeline stage writes into.
        token = secrets.randbits(48) if roles.num_stages > 1 and roles.main_writer else None
        if roles.main_writer:
            try:
                self.target = AtomicTarget(checkpoint, is_file=as_file, token=token)
            except Exception as e:  # noqa: BLE001 - agreed just below
                self.error = e
        agreed_token, failed = agree([float(token or 0), float(self.error is not None)], roles)
        if failed:
            raise_agreed_failure(self.error, roles, f"{what}({checkpoint!r})")
        if roles.stage_writer and not roles.main_writer:      # another stage: write into rank 0's folder
            try:
                self.target = AtomicTarget(checkpoint, is_file=as_file, token=int(agreed_token), owner=False)
            except Exception as e:  # noqa: BLE001 - agreed on every rank in finish()
                self.error = e

    def add(self, name, payload, nbytes: int) -> None:
        """Queue one item (stage writer only; a no-op elsewhere); a full shard file is written now."""
        if not self.roles.stage_writer:
            return
        if self.shard and starts_new_file(self._pending_bytes, not self._pending, nbytes, self.limit):
            self._flush()
        if self.defers:                       # staged in host memory now: training may change it after the save
            payload = self.log.freeze(payload)
        self._pending[name] = payload
        self._pending_bytes += nbytes

    @property
    def defers(self) -> bool:
        """An asynchronous save: items are staged in host buffers and written later (`file_log`)."""
        return self.log is not None and self.log.defer

    def _write(self, payload: dict, path: str, defer: bool = True) -> None:
        """Write one file (inside a training-checkpoint step: through its log, which may defer it)."""
        if self.error is None:
            try:
                if self.log is None:
                    self.write_file(payload, path)
                else:
                    # a file target is committed by renaming the file itself, so it is written now (inside a
                    # training checkpoint only the LR scheduler's small file is saved that way)
                    self.log.write(self.write_file, payload, path, defer and not self.as_file, frozen=True)
            except Exception as e:  # noqa: BLE001
                self.error = e

    def _flush(self) -> None:
        if self._pending:
            staged = f".part-{self.roles.stage}-{len(self.parts)}.tmp"   # torch.save needs an extension
            self._write(self._pending, os.path.join(self.target.path, staged) if self.target else staged)
            self.parts.append(WrittenFile(staged, list(self._pending), self._pending_bytes))
        self._pending, self._pending_bytes = {}, 0

    def finish(self, extra=None, finalize: Callable[[str, list[WrittenFile], list], None] | None = None) -> None:
        """Write what is left, agree, let global rank 0 `finalize(folder, files of every stage, extras
        of every stage)` (index, config) and commit. Raises on every rank when any rank failed."""
        roles = self.roles
        if roles.stage_writer:
            if self.shard:
                self._flush()
            elif self.target is not None and roles.num_stages > 1:
                self._stage_part()           # merged into the one file by the main writer below
            elif self.target is not None:
                path = self.target.path if self.as_file else os.path.join(self.target.path, self.single_name)
                self._write(self._pending, path)
                self.parts = [WrittenFile(os.path.basename(path), list(self._pending), self._pending_bytes)]
                self._pending = {}
        if self.shard:
            first, total = 0, len(self.parts)
            if roles.num_stages > 1:             # number the files across stages (one all-reduce)
                counts = [0.0] * (roles.num_stages + 1)
                if roles.stage_writer:
                    counts[roles.stage] = float(len(self.parts))
                counts[-1] = float(self.error is not None)
                counts = agree(counts, roles)
                if counts[-1]:
                    self._abort()
                first, total = int(sum(counts[:roles.stage])), int(sum(counts[:roles.num_stages]))
            if roles.stage_writer:
                self._number(first, total)
        if roles.num_stages > 1:
            if roles.stage_writer and not roles.main_writer and self.error is None:
                try:
                    # beside the files, in the staging folder (the target's own path is a file for as_file)
                    torch.save({"files": [(f.name, f.names, f.nbytes) for f in self.parts], "extra": extra},
                               os.path.join(self.target.staging, f".stage{roles.stage}.part"))
                except Exception as e:  # noqa: BLE001
                    self.error = e
            if self._failed():                   # every stage has written its part (a barrier)
                self._abort()
        if roles.main_writer and self.error is None:
            try:
                files, extras = list(self.parts), [extra]
                for s in range(1, roles.num_stages):
                    path = os.path.join(self.target.staging, f".stage{s}.part")
                    part = torch.load(path, weights_only=True)
                    os.remove(path)
                    files += [WrittenFile(*f) for f in part["files"]]
                    extras.append(part["extra"])
                if not self.shard and roles.num_stages > 1:
                    files = [self._merge_parts(files)]
                if finalize is not None:
                    finalize(self.target.path if not self.as_file else self.target.staging, files, extras)
                self.target.commit()
            except Exception as e:  # noqa: BLE001
                self.error = e
        if self._failed():
            self._abort()
        if self.log is not None and self.target is not None:   # the main writer has committed (a barrier above)
            self.log.moved(self.target.path, self.target.target)

    def _stage_part(self) -> None:
        """This stage's tensors of an unsharded save over stages, in a part file of the staging folder."""
        name = f".part-{self.roles.stage}-0.tmp"
        self._write(self._pending, os.path.join(self.target.staging, name), defer=False)   # read back below
        self.parts = [WrittenFile(name, list(self._pending), self._pending_bytes)]
        self._pending = {}

    def _merge_parts(self, parts: list[WrittenFile]) -> WrittenFile:
        """Main writer: every stage's part read back in stage order and written as the one file."""
        merged: dict = {}
        for f in parts:
            path = os.path.join(self.target.staging, f.name)
            merged.update(self.read_file(path))
            os.remove(path)
        path = self.target.path if self.as_file else os.path.join(self.target.path, self.single_name)
        if self.log is None:
            self.write_file(merged, path)
        else:
            self.log.write(self.write_file, merged, path, defer=not self.as_file)   # as in _write
        return WrittenFile(os.path.basename(path), list(merged), sum(f.nbytes for f in parts))

    def _number(self, first: int, total: int) -> None:
        """Rename this stage's parts to their final names, k-of-N across stages."""
        for k, f in enumerate(self.parts, start=first + 1):
            final = self.shard_name(k, total)
            if self.error is None:
                try:
                    old, new = os.path.join(self.target.path, f.name), os.path.join(self.target.path, final)
                    if self.log is not None:
                        self.log.rename(old, new)
                    else:
                        os.replace(old, new)
                except Exception as e:  # noqa: BLE001
                    self.error = e
            f.name = final

    def _failed(self) -> bool:
        return any_failed(self.error, self.roles)

    def discard(self) -> None:
        """This rank's part of a save its caller abandons on an exception (no collective): the
        staging folder goes and the save lock is released, so a later save is not refused."""
        if self.target is not None:
            self.target.abort()

    def _abort(self) -> None:
        if self.target is not None:               # any stage writer may hold the shared folder
            self.target.abort()
        raise_agreed_failure(self.error, self.roles, f"{self.what}({self.checkpoint!r})")


def raise_agreed_failure(error: BaseException | None, roles: SaveRoles, what: str) -> None:
    """Called by every rank once some rank failed: every rank learns what failed where (also the
    barrier: nobody returns before cleanup), then the failing ranks raise their own error and the
    others a RuntimeError quoting it, instead of a pointer to another rank's log."""
    mine = None if error is None else f"{type(error).__name__}: {error}"
    if roles.group is not None:
        errors = [None] * dist.get_world_size(roles.group)
        dist.all_gather_object(errors, mine, group=roles.group)
    else:
        errors = [mine]
    if error is not None:
        raise error
    rank, message = next((r, e) for r, e in enumerate(errors) if e is not None)
    raise RuntimeError(f"{what} failed on rank {rank}: {message}. Any existing checkpoint there is unchanged.")


def any_failed(error: BaseException | None, roles: SaveRoles) -> bool:
    """Agree over every rank whether any rank failed (one MAX all-reduce; also a barrier)."""
    flag = torch.tensor([1.0 if error is not None else 0.0], device=roles.device)
    if roles.group is not None:
        comm.all_reduce(flag, roles.group, op=dist.ReduceOp.MAX)
    return flag.item() > 0
