"""The HuggingFace checkpoint layout on disk: file names, shard planning, file writers, the index
and atomic placement.

Owns: deciding which tensor goes into which file (from sizes alone, so every rank computes the
same plan without communicating), writing one weights file (safetensors or torch pickle), the
`*.index.json` with its `weight_map`, and `AtomicTarget`, which stages everything in a temporary
path beside the target and renames it into place only when complete. Must not gather tensors or
communicate (that is `model_io.py`).

Pipeline stages (later): each stage plans its own files with a distinct `prefix` (e.g.
"stage1"), writes them into the same staging folder, and one rank merges the stages' weight maps
with `write_index` before `AtomicTarget.commit()`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import torch

SAFE_WEIGHTS_NAME, SAFE_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
BIN_WEIGHTS_NAME, BIN_INDEX_NAME = "pytorch_model.bin", "pytorch_model.bin.index.json"
SINGLE_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass
class WeightsFile:
    """One weights file of a plan: its name (inside the checkpoint folder) and tensor names."""

    name: str
    tensor_names: list[str] = field(default_factory=list)
    nbytes: int = 0


def index_name(use_safetensors: bool) -> str:
    return SAFE_INDEX_NAME if use_safetensors else BIN_INDEX_NAME


def plan_files(sizes: dict[str, int], shard: bool, use_safetensors: bool, size_per_shard_mb: float = 1024,
               prefix: str | None = None) -> list[WeightsFile]:
    """Split tensors (name -> bytes, in state-dict order) into HF-named files.

    shard=False: one file (model.safetensors / pytorch_model.bin). shard=True: greedy files of at
    most `size_per_shard_mb` MB (a larger tensor gets a file of its own) named
    model-0000k-of-0000N.safetensors / pytorch_model-0000k-of-0000N.bin, optionally `prefix-`ed.
    """
    if not shard:
        return [WeightsFile(SAFE_WEIGHTS_NAME if use_safetensors else BIN_WEIGHTS_NAME, list(sizes),
                            sum(sizes.values()))]
    limit = size_per_shard_mb * 1024 * 1024
    files: list[WeightsFile] = []
    for name, nbytes in sizes.items():
        if not files or (files[-1].tensor_names and files[-1].nbytes + nbytes > limit):
            files.append(WeightsFile(""))
        files[-1].tensor_names.append(name)
        files[-1].nbytes += nbytes
    return number_shards(files, use_safetensors, prefix)


def number_shards(files: list[WeightsFile], use_safetensors: bool, prefix: str | None = None, first: int = 1,
                  total: int | None = None) -> list[WeightsFile]:
    """Name shard files k-of-N in place; pipeline stages number theirs from `first` out of `total`."""
    stem, ext = (SAFE_WEIGHTS_NAME if use_safetensors else BIN_WEIGHTS_NAME).rsplit(".", 1)
    lead = f"{prefix}-" if prefix else ""
    total = len(files) if total is None else total
    for k, f in enumerate(files, start=first):
        f.name = f"{lead}{stem}-{k:05d}-of-{total:05d}.{ext}"
    return files


def write_fragment(folder: str, stage: int, files: list[WeightsFile]) -> None:
    """One pipeline stage's part of the index, merged by `read_fragments` before the index is written."""
    with open(os.path.join(folder, f".stage{stage}.json"), "w", encoding="utf-8") as fh:
        json.dump([[f.name, f.tensor_names, f.nbytes] for f in files], fh)


def read_fragments(folder: str, stages: range) -> list[WeightsFile]:
    """The files the other stages wrote (fragments are removed once read)."""
    out = []
    for s in stages:
        path = os.path.join(folder, f".stage{s}.json")
        with open(path, encoding="utf-8") as fh:
            out += [WeightsFile(name, names, nbytes) for name, names, nbytes in json.load(fh)]
        os.remove(path)
    return out


def write_weights(tensors: dict[str, torch.Tensor], path: str, use_safetensors: bool) -> None:
    """Write one weights file (tensors must be full, contiguous and on the CPU)."""
    if use_safetensors:
        from safetensors.torch import save_file
        save_file(tensors, path, metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def write_index(folder: str, files: list[WeightsFile], use_safetensors: bool) -> str:
    """Write the HF index (`metadata.total_size` and `weight_map`: tensor name -> file)."""
    index = {"metadata": {"total_size": sum(f.nbytes for f in files)},
             "weight_map": {n: f.name for f in files for n in f.tensor_names}}
    path = os.path.join(folder, index_name(use_safetensors))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path


class AtomicTarget:
    """Stage a checkpoint folder (or single file) beside `target`; `commit()` puts it in place.

    Until `commit()`, `target` is untouched; `abort()` removes the staging folder. A folder target
    that already exists is moved aside, replaced, then deleted, so a reader only ever sees the old
    complete checkpoint or the new complete one.
    """

    def __init__(self, target: str, is_file: bool, token: int | None = None):
        self.target = os.path.abspath(target)
        self.is_file = is_file
        parent = os.path.dirname(self.target)
        if os.path.isdir(self.target) if is_file else os.path.isfile(self.target):
            kind = "a folder" if is_file else "a file"
            raise ValueError(f"checkpoint path {target!r} is {kind}; pass a "
                             f"{'file name ending in .safetensors/.bin' if is_file else 'folder path'} instead")
        os.makedirs(parent, exist_ok=True)
        if token is None:
            self.staging = tempfile.mkdtemp(prefix=f".{os.path.basename(self.target)}.tmp-", dir=parent)
        else:  # one staging folder shared by several writers (pipeline stages), named by an agreed token
            self.staging = os.path.join(parent, f".{os.path.basename(self.target)}.tmp-{token:012x}")
            os.makedirs(self.staging, exist_ok=True)
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
