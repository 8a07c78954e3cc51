"""Atomic placement of a checkpoint: a staging folder beside the target, put in place at once, by
one live writer at a time.

Owns: `AtomicTarget` (stage a folder or file beside its target; `commit` puts it in place), the
save lock (`SaveLock`: a `.{name}.lock` file beside the target, `flock`ed for the whole save, naming
its owner), the exchange that makes replacing an existing folder atomic (`replace_folder`:
`renameat2(RENAME_EXCHANGE)`, so the path holds the old complete checkpoint or the new one at every
instant), and the recovery of what a dead save left (`clean_leftovers` for the lock holder,
`recover` for loaders). Must not know what a checkpoint holds.

Where the kernel or file system cannot exchange (NFS, many network and FUSE file systems), the old
folder is moved aside (`.{name}.old-*/ckpt`) and the new one renamed in: a crash between the two
renames leaves the old checkpoint beside the path, never a partial one at it. Whoever comes next
puts it back: the next save (holding the lock) or a loader (`recover`, refused while a live save
holds the lock: that save is between its renames and will finish).

The lock is released by the kernel when its holder dies, so holding it means no other live writer
of the target exists: only the holder removes staging folders (`.{name}.tmp-*`), and only those of
dead saves can be left then. On NFS, Linux maps `flock` onto POSIX locks held through the lock
manager; a crashed client's locks go when its lease ends (NFSv4: 90 s by default).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
import warnings

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV, errno.EPERM}
_NO_LOCKS = {errno.ENOLCK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS}
_LOCK_TRIES, _LOCK_WAIT_S = 10, 0.05      # a holder that is just releasing (or a loader recovering) waits a moment


class SaveInProgress(RuntimeError):
    """Another live process holds the save lock of a checkpoint."""


def exchange(a: str, b: str) -> bool:
    """Atomically swap the two existing paths (Linux renameat2 RENAME_EXCHANGE); False where the
    platform or file system cannot, an OSError on a real failure."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, f"exchanging {a!r} and {b!r}: {os.strerror(code)}")


def lock_file_of(target: str) -> str:
    """The lock file of checkpoint `target`: `.{name}.lock` beside it."""
    target = os.path.abspath(target)
    return os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.lock")


def _rank() -> int | None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ["RANK"]) if os.environ.get("RANK", "").isdigit() else None


def _describe(owner: dict | None) -> str:
    if not owner:
        return "owner not written yet: a save just starting, or loaders putting a checkpoint back"
    rank = f", global rank {owner['rank']}" if owner.get("rank") is not None else ""
    return f"pid {owner.get('pid')} on host {owner.get('host')}{rank}, started {owner.get('started')}"


class SaveLock:
    """The exclusive right to save `target`, held by one live process: `flock` on `lock_file`.

    `acquire()` takes it (or raises `SaveInProgress` naming the holder) and writes this process's
    name into the file; `release()` removes the file and lets go. `shared()` (loaders) is held by
    any number of processes at once, never together with a save. Each attempt re-opens the path and
    checks that the file it locked is still the one there (a holder may remove it while we lock).
    """

    def __init__(self, lock_file: str, target: str):
        self.lock_file, self.target = lock_file, target
        self._fd: int | None = None

    def _try(self, shared: bool) -> tuple[int, bool] | None:
        """(fd, created): the lock held on the file now at the path; None while another holds it."""
        while True:
            created = True
            try:
                fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                created = False
                try:
                    fd = os.open(self.lock_file, os.O_RDWR)
                except FileNotFoundError:
                    continue                                   # released between the two opens
            try:
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            except BaseException:
                os.close(fd)
                raise
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(self.lock_file))
            except FileNotFoundError:
                current = False
            if current:
                return fd, created
            os.close(fd)                                       # its holder removed it: lock the new file

    def _locked(self, shared: bool) -> tuple[int, bool] | None:
        """`_try` for a moment (a save that is just finishing, a loader recovering), then None.
        Without lock support on the file system: a warning and (-1, False)."""
        for _ in range(_LOCK_TRIES):
            try:
                got = self._try(shared)
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    raise
                warnings.warn(f"cannot lock {self.lock_file!r} ({e.strerror}): this file system has no locks, so a "
                              f"concurrent save to {self.target!r} is not detected", stacklevel=4)
                return -1, False
            if got is not None:
                return got
            time.sleep(_LOCK_WAIT_S)
        return None

    def owner(self) -> dict | None:
        """What the holder wrote into the lock file (None: unreadable or not written yet)."""
        try:
            with open(self.lock_file, encoding="utf-8") as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    def acquire(self) -> SaveLock:
        got = self._locked(shared=False)
        if got is None:
            raise SaveInProgress(f"another save is writing checkpoint {self.target!r} ({_describe(self.owner())}); "
                                 f"wait for it to finish or save elsewhere (its lock: {self.lock_file})")
        self._fd = got[0]
        if self._fd >= 0:
            owner = {"host": socket.gethostname(), "pid": os.getpid(), "rank": _rank(), "target": self.target,
                     "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "time": time.time()}
            os.ftruncate(self._fd, 0)
            os.write(self._fd, json.dumps(owner).encode())
        return self

    def release(self) -> None:
        """Remove the lock file, then let go (in this order: nobody locks a file about to vanish
        and believes it current). Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None or fd < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.lock_file)
        os.close(fd)

    @contextlib.contextmanager
    def shared(self):
        """Held while a loader puts a moved-aside checkpoint back: never during a save."""
        got = self._locked(shared=True)
        if got is None:
            raise SaveInProgress(f"checkpoint {self.target!r} is being replaced by a save in progress "
                                 f"({_describe(self.owner())}); load it once that save has finished")
        fd, created = got
        try:
            yield
        finally:
            if fd >= 0:
                if created:                                    # leave no lock file of ours behind
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.lock_file)
                os.close(fd)


def _asides(target: str) -> list[str]:
    """Old checkpoints a dead save moved aside (`.{name}.old-*/ckpt`), oldest name first."""
    parent, base = os.path.split(target)
    try:
        entries = os.listdir(parent)
    except OSError:
        return []
    return sorted(os.path.join(parent, e) for e in entries if e.startswith(f".{base}.old-"))


def _put_back(target: str) -> None:
    """Put a moved-aside checkpoint back at `target` when nothing took its place; drop the rest.
    Concurrent callers tolerate each other: os.replace is atomic, the loser finds nothing to move."""
    for aside in _asides(target):
        kept = os.path.join(aside, "ckpt")
        if os.path.exists(kept) and not os.path.exists(target):
            try:
                os.replace(kept, target)
            except OSError:
                if not os.path.exists(target):                 # not another recoverer winning the race
                    raise
        if not os.path.exists(kept):
            shutil.rmtree(aside, ignore_errors=True)


def clean_leftovers(target: str) -> None:
    """The save lock's holder, before a save to `target`: staging folders and files of dead saves
    (`.{name}.tmp-*`) are removed; an old checkpoint moved aside by a save that died between its
    two renames is put back when nothing took its place, else removed."""
    target = os.path.abspath(target)
    parent, base = os.path.split(target)
    for entry in os.listdir(parent):
        if entry.startswith(f".{base}.tmp-"):
            path = os.path.join(parent, entry)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
    _put_back(target)
    for aside in _asides(target):                              # replaced by a complete checkpoint
        shutil.rmtree(aside, ignore_errors=True)


def recover(target: str, lock_file: str | None = None) -> bool:
    """Loaders, before reading `target`: when it is missing and a save that died between its two
    renames left the old checkpoint aside, put it back (True). Raises `SaveInProgress` while a live
    save holds the lock (`lock_file`, by default `lock_file_of(target)`): it is replacing the folder.
    Nothing is touched (one stat) when `target` exists; several ranks may recover at once."""
    target = os.path.abspath(target)
    if os.path.exists(target) or not _asides(target):
        return False
    lock = SaveLock(lock_file or lock_file_of(target), target)
    try:
        with lock.shared():
            _put_back(target)
    except OSError as e:
        raise OSError(e.errno, f"checkpoint {target!r} is missing: a save that died moved it to "
                               f"{_asides(target)[:1]} and putting it back failed ({e.strerror}); move that "
                               f"folder's `ckpt` to {target!r}") from e
    return os.path.exists(target)


def replace_folder(staging: str, target: str) -> None:
    """Put folder `staging` at `target` (which may exist) at once: one exchange where the file
    system can, else move the old one aside, rename the new one in, delete the old one."""
    if os.path.isdir(target) and exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)             # now holds the old checkpoint
        return
    old = None
    if os.path.exists(target):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
        os.replace(target, os.path.join(old, "ckpt"))
    try:
        os.replace(staging, target)
    except BaseException:
        if old is not None:                                    # put the old checkpoint back
            os.replace(os.path.join(old, "ckpt"), target)      # (if this fails, it stays aside: recoverable)
            os.rmdir(old)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class AtomicTarget:
    """Stage a checkpoint folder (or single file) beside `target`; `commit()` puts it in place.

    The owner (default) takes the target's save lock first (`SaveInProgress` while another live
    save holds it), then removes what dead saves left, and keeps the lock until `commit()` or
    `abort()`. Other writers of a shared staging folder (pipeline stages; `token` names the folder,
    agreed after the owner took the lock) pass owner=False: they only write into it.
    Until `commit()`, `target` is untouched; `abort()` removes the staging folder.
    """

    def __init__(self, target: str, is_file: bool, token: int | None = None, owner: bool = True):
        if not owner and token is None:
            raise ValueError("AtomicTarget(owner=False) writes into a shared staging folder: pass its token")
        self.target = os.path.abspath(target)
        self.is_file = is_file
        self.lock: SaveLock | None = None
        parent, base = os.path.split(self.target)
        if os.path.isdir(self.target) if is_file else os.path.isfile(self.target):
            kind = "a folder" if is_file else "a file"
            raise ValueError(f"checkpoint path {target!r} is {kind}; pass a "
                             f"{'file name ending in .safetensors/.bin' if is_file else 'folder path'} instead")
        try:
            os.makedirs(parent, exist_ok=True)
            if owner:
                self.lock = SaveLock(lock_file_of(self.target), self.target).acquire()
                clean_leftovers(self.target)
            if token is None:
                self.staging = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
            else:  # one staging folder shared by several writers (pipeline stages), named by an agreed token
                self.staging = os.path.join(parent, f".{base}.tmp-{token:012x}")
                os.makedirs(self.staging, exist_ok=True)
        except OSError as e:
            self.release()
            raise OSError(e.errno, f"cannot write a checkpoint at {target!r}: staging beside it in {parent!r} "
                                   f"failed ({e.strerror}); choose a folder this process can write") from e
        except BaseException:
            self.release()
            raise
        self.path = (os.path.join(self.staging, base) if is_file else self.staging)

    def _apply_umask(self) -> None:
        """mkdtemp makes the staging folder private (0700); give the result ordinary permissions."""
        umask = os.umask(0)
        os.umask(umask)
        for root, _, names in os.walk(self.staging):
            os.chmod(root, 0o777 & ~umask)
            for n in names:
                os.chmod(os.path.join(root, n), 0o666 & ~umask)

    def commit(self) -> None:
        self._apply_umask()
        if self.is_file:
            os.replace(self.path, self.target)            # atomic on POSIX
            shutil.rmtree(self.staging, ignore_errors=True)
        else:
            replace_folder(self.staging, self.target)
        self.release()

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)
        self.release()

    def release(self) -> None:
        """Let go of the save lock (after the commit or the abort; idempotent)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None
