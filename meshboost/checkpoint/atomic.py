"""Atomic placement of a checkpoint: a staging folder beside the target, put in place at once.

Owns: `AtomicTarget` (stage a folder or file beside its target; `commit` swaps it in) and the
exchange that makes replacing an existing folder atomic on Linux (`renameat2(RENAME_EXCHANGE)`:
at every instant the path holds the old complete checkpoint or the new one). Where the kernel or
file system cannot exchange, the old folder is moved aside and the new one renamed in: a crash
between the two renames leaves the old checkpoint beside the path (in `.{name}.old-*`), never a
partial one at it, and the next save to that path puts it back first; staging folders of saves
that died are removed by the next save to the same path. Must not know what a checkpoint holds.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import tempfile

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV, errno.EPERM}


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


class AtomicTarget:
    """Stage a checkpoint folder (or single file) beside `target`; `commit()` puts it in place.

    Until `commit()`, `target` is untouched; `abort()` removes the staging folder. A folder target
    that already exists is exchanged with the staging folder in one step where the platform can
    (see the module docstring), else moved aside, replaced, then deleted.
    """

    def __init__(self, target: str, is_file: bool, token: int | None = None):
        self.target = os.path.abspath(target)
        self.is_file = is_file
        parent = os.path.dirname(self.target)
        if os.path.isdir(self.target) if is_file else os.path.isfile(self.target):
            kind = "a folder" if is_file else "a file"
            raise ValueError(f"checkpoint path {target!r} is {kind}; pass a "
                             f"{'file name ending in .safetensors/.bin' if is_file else 'folder path'} instead")
        try:
            os.makedirs(parent, exist_ok=True)
            base = os.path.basename(self.target)
            _recover_and_clean(parent, base, keep=None if token is None else f".{base}.tmp-{token:012x}")
            if token is None:
                self.staging = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.tmp-", dir=parent)
            else:  # one staging folder shared by several writers (pipeline stages), named by an agreed token
                self.staging = os.path.join(parent, f".{os.path.basename(self.target)}.tmp-{token:012x}")
                os.makedirs(self.staging, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"cannot write a checkpoint at {target!r}: staging beside it in {parent!r} "
                                   f"failed ({e.strerror}); choose a folder this process can write") from e
        self.path = (os.path.join(self.staging, os.path.basename(self.target)) if is_file else self.staging)

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
            return
        if os.path.isdir(self.target) and exchange(self.staging, self.target):
            shutil.rmtree(self.staging, ignore_errors=True)   # now holds the old checkpoint
            return
        old = None
        if os.path.exists(self.target):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.old-", dir=os.path.dirname(self.target))
            os.replace(self.target, os.path.join(old, "ckpt"))
        try:
            os.replace(self.staging, self.target)
        except BaseException:
            if old is not None:                            # put the old checkpoint back
                os.replace(os.path.join(old, "ckpt"), self.target)
            raise
        finally:
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)


def _recover_and_clean(parent: str, base: str, keep: str | None) -> None:
    """Before a save to `parent/base`: staging folders of saves that died (`.base.tmp-*`, except the
    shared one of this save, `keep`) are removed; an old checkpoint moved aside by a save that died
    between its two renames (`.base.old-*/ckpt`) is put back when nothing took its place, else
    removed. Several writers may run this at once: each step tolerates the others."""
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if entry.startswith(f".{base}.tmp-") and entry != keep:
            shutil.rmtree(path, ignore_errors=True)
        elif entry.startswith(f".{base}.old-"):
            kept, target = os.path.join(path, "ckpt"), os.path.join(parent, base)
            if os.path.exists(kept) and not os.path.exists(target):
                try:
                    os.replace(kept, target)
                except OSError:
                    pass                               # another writer put it back first
            shutil.rmtree(path, ignore_errors=True)
