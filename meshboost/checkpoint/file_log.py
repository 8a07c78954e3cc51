"""What one rank writes into a training-checkpoint step: every file's size and checksum, and, for an
asynchronous save, the files still to be written.

Owns: `FileLog` (the files this rank wrote under a staging folder, followed through the renames the
writer and the atomic commits make; with `defer`, each payload staged in host memory and written
later by `flush`), `HostBuffers` (the host memory staging takes: one step's tensors, reused by the
next save; pinned where CUDA is present), `checksum` and `durable` (fsync) writes. `recording(log)`
makes `CheckpointWriter` route its file writes through `log`. Must not communicate or decide what
a checkpoint holds.

Why a checksum of the file read back (zlib.crc32, about 1.6 GB/s in one CPU thread here): it covers
the bytes the file system holds whatever wrote them (safetensors, torch.save), without changing the
writers; the read comes from the page cache just filled.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import os
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

_CHUNK = 16 << 20
_RECORDING: contextvars.ContextVar = contextvars.ContextVar("meshboost_checkpoint_file_log", default=None)


def checksum(path: str, sync: bool = False) -> dict:
    """{"size", "crc32"} of the file at `path` (crc32 as 8 hex digits); sync: fsync it first."""
    crc, size = 0, 0
    with open(path, "rb") as fh:
        if sync:
            os.fsync(fh.fileno())
        while chunk := fh.read(_CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"size": size, "crc32": f"{crc:08x}"}


def fsync_dir(path: str) -> None:
    """Make the entries of folder `path` (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable(write: Callable[[object, str], None], payload, path: str) -> dict:
    """`write(payload, path)`, then the file fsynced and its checksum (tests replace this to inject a
    fault into a background write)."""
    write(payload, path)
    return checksum(path, sync=True)


class HostBuffers:
    """Host tensors staged tensors are copied into, the i-th of one save reused by the i-th of the
    next when its shape and dtype match (a save's tensors come in the same order every time); pinned
    where CUDA is present, so device copies run at full speed. Holds one step's state between saves."""

    def __init__(self):
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self.pinned = torch.cuda.is_available()

    def start(self) -> None:
        self._next = 0

    def stage(self, t: torch.Tensor) -> torch.Tensor:
        i, self._next = self._next, self._next + 1
        if i < len(self._buffers) and self._buffers[i].shape == t.shape and self._buffers[i].dtype == t.dtype:
            buf = self._buffers[i]
        else:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pinned)
            self._buffers[i:i + 1] = [buf]
        buf.copy_(t.detach(), non_blocking=self.pinned and t.is_cuda)
        return buf

    def trim(self) -> None:
        """Drop buffers this save did not use (a smaller state than the last one)."""
        del self._buffers[self._next:]

    @property
    def nbytes(self) -> int:
        """The bytes the staged tensors take."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    @property
    def held(self) -> int:
        """The host memory the buffers hold: torch's pinned allocator rounds each one up to a power of two."""
        sizes = [b.numel() * b.element_size() for b in self._buffers]
        return sum(1 << max(n - 1, 0).bit_length() for n in sizes) if self.pinned else sum(sizes)


def _frozen(payload, buffers: HostBuffers):
    """`payload` with every tensor copied into `buffers` and every other value deep-copied: training
    may change the originals as soon as the save returns."""
    if torch.is_tensor(payload):
        return buffers.stage(payload)
    if isinstance(payload, dict):
        out = copy.copy(payload)               # the same type (an OrderedDict; a defaultdict keeps its factory)
        for k, v in payload.items():
            out[k] = _frozen(v, buffers)
        return out
    if isinstance(payload, (list, tuple)) and type(payload) in (list, tuple):
        return type(payload)(_frozen(v, buffers) for v in payload)
    return copy.deepcopy(payload)


@dataclass
class _Pending:
    write: Callable[[object, str], None]
    payload: object
    name: str        # the file name it was given: written under it, then renamed (torch.save records it inside)


class FileLog:
    """The files one rank writes under `root` (a step's staging folder), by path: their checksum
    once written, or (defer=True) the staged payload still to write. `rename` and `moved` follow the
    writer's renames (shard numbering, a part's commit) so the paths are final ones."""

    def __init__(self, root: str, defer: bool = False, buffers: HostBuffers | None = None):
        self.root, self.defer = os.path.abspath(root), defer
        self.buffers = buffers if buffers is not None else HostBuffers()
        self.written: dict[str, dict] = {}
        self.pending: dict[str, _Pending] = {}
        if defer:
            self.buffers.start()

    def freeze(self, payload):
        """`payload` staged: tensors copied into the host buffers, other values deep-copied."""
        return _frozen(payload, self.buffers)

    def write(self, write: Callable[[object, str], None], payload, path: str, defer: bool = True,
              frozen: bool = False) -> None:
        """Write `payload` at `path` now (fsynced, checksummed), or with defer (on a deferring log)
        stage it (unless `frozen` already) for `flush`."""
        path = os.path.abspath(path)
        if self.defer and defer:
            self.pending[path] = _Pending(write, payload if frozen else self.freeze(payload), os.path.basename(path))
        else:
            self.written[path] = durable(write, payload, path)

    def rename(self, old: str, new: str) -> None:
        """A file moved by its writer: on disk, or (not written yet) in the log."""
        old, new = os.path.abspath(old), os.path.abspath(new)
        if old in self.pending:
            self.pending[new] = self.pending.pop(old)
            return
        os.replace(old, new)
        if old in self.written:
            self.written[new] = self.written.pop(old)

    def moved(self, old: str, new: str) -> None:
        """Folder (or file) `old` was renamed `new` by a commit: every logged path under it follows."""
        old, new = os.path.abspath(old), os.path.abspath(new)
        for table in (self.written, self.pending):
            for path in [p for p in table if p == old or p.startswith(old + os.sep)]:
                table[new + path[len(old):]] = table.pop(path)

    def staged(self) -> None:
        """End of the synchronous part: device copies landed, unused buffers dropped."""
        if self.buffers.pinned:
            torch.cuda.synchronize()
        self.buffers.trim()

    def flush(self) -> None:
        """Write the deferred files (in path order), each fsynced and checksummed."""
        for path in sorted(self.pending):
            job = self.pending[path]
            os.makedirs(os.path.dirname(path), exist_ok=True)
            first = os.path.join(os.path.dirname(path), job.name)   # the bytes a synchronous save writes
            self.written[path] = durable(job.write, job.payload, first)
            if first != path:
                os.replace(first, path)
            del self.pending[path]

    def entries(self) -> dict[str, dict]:
        """{path relative to root: {"size", "crc32"}} of the files written."""
        return {os.path.relpath(p, self.root): v for p, v in self.written.items() if p.startswith(self.root + os.sep)}


def recording(log: FileLog | None):
    """Within it, `CheckpointWriter`s route their file writes through `log` (None: write directly)."""
    @contextlib.contextmanager
    def scope():
        token = _RECORDING.set(log)
        try:
            yield log
        finally:
            _RECORDING.reset(token)
    return scope()


def current() -> FileLog | None:
    """The log of the save in progress in this context, if any."""
    return _RECORDING.get()
