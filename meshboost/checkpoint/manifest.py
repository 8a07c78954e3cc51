"""The file manifest of a training-checkpoint step: every file's size and crc32, recorded at the
commit (meta.json's "files") and checked before a load.

Owns: building the manifest from what each rank's `FileLog` wrote plus the small files written
directly (index, config, groups), made durable before the commit (`manifest_of`), and checking a
step's files against it, the work split over the ranks (`verify_step`: raises naming the file).
Must not communicate (the callers agree on failures).
"""

from __future__ import annotations

import os
import warnings

from meshboost.checkpoint.file_log import checksum, fsync_dir

MANIFEST = "files"          # the key of meta.json that holds it
_META = "meta.json"


def manifest_of(staging: str, written: list[dict[str, dict]]) -> dict[str, dict]:
    """{relative path: {"size", "crc32"}} of every file under `staging` (meta.json excepted, written
    after): what the ranks logged (`written`, one table per rank, each fsynced by its writer), the rest
    checksummed and fsynced here; every folder fsynced too, so the commit names durable files only."""
    logged: dict[str, dict] = {}
    for rank, table in enumerate(written):
        for rel, entry in table.items():
            if not os.path.isfile(os.path.join(staging, rel)):
                raise FileNotFoundError(f"rank {rank} wrote {rel!r} into the step, but it is not in {staging!r} at "
                                        "the commit: do the ranks share one file system?")
            logged[rel] = entry
    files: dict[str, dict] = {}
    for root, dirs, names in os.walk(staging, topdown=False):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), staging)
            if rel != _META:
                files[rel] = logged.get(rel) or checksum(os.path.join(root, n), sync=True)
        fsync_dir(root)
    return dict(sorted(files.items()))


def _verify_file(step_folder: str, rel: str, recorded: dict) -> None:
    path = os.path.join(step_folder, rel)
    fix = ("restore it, or point 'latest' at another step (load_checkpoint(verify=False) skips this check, "
           "and then loads whatever the file holds)")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"checkpoint file {path!r} is missing; its step recorded {recorded['size']} bytes: "
                                f"{fix}")
    size = os.path.getsize(path)
    if size != recorded["size"]:
        raise RuntimeError(f"checkpoint file {path!r} has {size} bytes; its step recorded {recorded['size']} at the "
                           f"save: it was truncated or replaced; {fix}")
    now = checksum(path)["crc32"]
    if now != recorded["crc32"]:
        raise RuntimeError(f"checkpoint file {path!r} fails its checksum (crc32 {now}, recorded {recorded['crc32']} "
                           f"at the save; {size} bytes): it was changed or damaged after the save; {fix}")


def verify_step(step_folder: str, meta: dict, parts: list[str], rank: int, world: int) -> None:
    """Check this rank's share of the files of `step_folder` that a load of `parts` reads (the files
    of those parts, the rank files and any other top-level file) against meta.json's manifest: the
    files are dealt out over the `world` ranks, largest first. A step saved before manifests existed
    loads with a warning."""
    files = meta.get(MANIFEST)
    if files is None:
        if rank == 0:
            warnings.warn(f"{step_folder} has no file checksums (saved by an older meshboost): loaded unverified",
                          stacklevel=4)
        return
    others = set(meta.get("parts", [])) - set(parts)
    wanted = sorted((rel for rel in files if rel.split("/", 1)[0] not in others),
                    key=lambda rel: (-files[rel]["size"], rel))
    for rel in wanted[rank::world]:
        _verify_file(step_folder, rel, files[rel])
