"""Topology-free optimizer checkpoints (states keyed by parameter name, as full tensors) and the
LR scheduler's state.

Owns: serialising what a boosted optimizer exports (`OptimizerWrapper.export_state` /
`export_meta`, in the one format of `meshboost.optim.state`) under the names of `names.py`, and
reading it back lazily for `import_state`, which checks names, groups and shapes and cuts each
entry into the loading optimizer's layout. Must not know where an optimizer keeps its state (the
optimizer does) nor how a save is staged and committed (`writer.py`).

On disk (written atomically by the writer):
  shard=False: one torch file at `checkpoint` {"format", "state": {name: entry}, "extra": {...}}; over
               pipeline stages each stage stages its entries and global rank 0 writes the one file.
  shard=True:  a folder: optimizer-0000k-of-0000N.bin ({name: entry}), optimizer.groups.bin (the
               "extra" part) and optimizer.index.json {"format", "weight_map": name -> file,
               "param_groups": "optimizer.groups.bin"}. Pipeline stages each write their own files;
               global rank 0 merges the stages' extras.
"extra" = the optimizer's meta (format, param groups with params by name, loss-scaler state) plus
"aliases" (every name a parameter goes by -> the name it is saved under). The optimizer checks the
format when it imports.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.checkpoint.atomic import recover
from meshboost.checkpoint.load import open_weights
from meshboost.checkpoint.names import ParamNames
from meshboost.checkpoint.writer import CheckpointWriter, save_roles

INDEX_NAME = "optimizer.index.json"
GROUPS_NAME = "optimizer.groups.bin"


def _write_file(obj, path: str) -> None:
    """Write one torch file (tests replace this to simulate a crash)."""
    torch.save(obj, path)


def _trained(optimizer) -> list[torch.Tensor]:
    return [p for params in optimizer.working_param_groups for p in params]


# -- save ----------------------------------------------------------------------------------------
def save_optimizer(optimizer, model: nn.Module, checkpoint: str, shard: bool = False, size_per_shard: float = 1024,
                   prefix: str | None = None, mesh=None) -> None:
    """Write the state of boosted `optimizer`, built on `model` (the user's model at its layout over
    `mesh`), at `checkpoint`; call it on every rank. shard=False: one file. shard=True: a folder of
    files of at most `size_per_shard` MB plus the index. The result loads at any other layout."""
    if not isinstance(size_per_shard, (int, float)) or size_per_shard <= 0:
        raise ValueError(f"size_per_shard={size_per_shard!r} must be a positive number of megabytes")
    if prefix and not shard:
        raise ValueError(f"prefix={prefix!r} names shard files; it only applies with shard=True")
    roles = save_roles(mesh)
    names = ParamNames(model)
    key_of = names.key_of(_trained(optimizer))
    extra = {**optimizer.export_meta(key_of), "aliases": names.aliases()}
    if roles.num_stages > 1 and not shard:
        # one file over pipeline stages (ColossalAI's): its extra lists every stage's parameters, so every rank
        # learns the others' now (one all-gather of small dicts); rank 0 merges the stages' entries
        every = [None] * dist.get_world_size(roles.group)
        dist.all_gather_object(every, (roles.stage, extra), group=roles.group)
        extra = _merge_extras([e for _, e in sorted(every, key=lambda se: se[0])])

    def write_file(entries: dict, path: str) -> None:
        _write_file(entries if shard else {"format": extra.get("format"), "state": entries, "extra": extra}, path)

    writer = CheckpointWriter(
        checkpoint, roles, shard=shard, as_file=not shard, size_per_shard_mb=size_per_shard,
        shard_name=lambda k, total: f"{prefix + '-' if prefix else ''}optimizer-{k:05d}-of-{total:05d}.bin",
        write_file=write_file, read_file=_read_entries, what="save_optimizer")
    try:
        # an asynchronous save stages each tensor straight from where it lives into its (pinned) host buffer
        for key, entry in optimizer.export_state(key_of, replica0_only=True, live=writer.defers):
            if entry is not None:
                tensors = list(entry["per_element"].values()) + ([entry["master"]] if "master" in entry else [])
                writer.add(key, entry, sum(t.numel() * t.element_size() for t in tensors))
    except BaseException:
        writer.discard()                          # no staging folder or save lock outlives a raised save
        raise
    writer.finish(extra, _write_index if shard else None)


def _merge_extras(extras: list[dict]) -> dict:
    """The stages' extras (in stage order; their param groups list only their own parameters) as one."""
    extra = extras[0]
    for other in extras[1:]:
        extra["aliases"].update(other["aliases"])
        for mine, theirs in zip(extra["param_groups"], other["param_groups"]):
            mine["params"] += [n for n in theirs["params"] if n not in mine["params"]]
    return extra


def _read_entries(path: str) -> dict:
    """The entries of one file `write_file` wrote with shard=False (a stage's part, merged by rank 0)."""
    return torch.load(path, map_location="cpu", weights_only=True)["state"]


def _write_index(folder: str, files, extras: list[dict]) -> None:
    """Merge the stages' extras and write the groups file and the index (global rank 0)."""
    extra = _merge_extras(extras)
    torch.save(extra, os.path.join(folder, GROUPS_NAME))
    with open(os.path.join(folder, INDEX_NAME), "w", encoding="utf-8") as fh:
        json.dump({"format": extra.get("format"), "metadata": {"total_size": sum(f.nbytes for f in files)},
                   "weight_map": {n: f.name for f in files for n in f.names}, "param_groups": GROUPS_NAME},
                  fh, indent=2, sort_keys=True)


# -- load ----------------------------------------------------------------------------------------
class OptimizerCheckpoint(Mapping):
    """The entries of a saved optimizer, read lazily (memory-mapped): a mapping name -> entry, plus
    `extra` and `resolve`."""

    def __init__(self, path: str):
        self._files: dict[str, dict] = {}
        recover(path)                              # a folder a dead save's commit left aside comes back
        if os.path.isfile(path):
            blob = open_weights(path, lambda: torch.load(path, map_location="cpu", mmap=True, weights_only=True))
            if not isinstance(blob, dict) or not {"format", "state", "extra"} <= set(blob):
                raise ValueError(f"{path!r} is not a meshboost optimizer checkpoint (saved by save_optimizer)")
            self.extra, self.weight_map = blob["extra"], {n: path for n in blob["state"]}
            self._files[path] = blob["state"]
            return
        index = os.path.join(path, INDEX_NAME)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"optimizer checkpoint {path!r} does not exist")
        if not os.path.exists(index):
            raise RuntimeError(f"optimizer checkpoint folder {path!r} has no {INDEX_NAME}: it is incomplete (an "
                               "interrupted save or copy?) or not an optimizer checkpoint")
        with open(index, encoding="utf-8") as fh:
            meta = json.load(fh)
        files = sorted(set(meta["weight_map"].values())) + [meta["param_groups"]]
        missing = [f for f in files if not os.path.exists(os.path.join(path, f))]
        if missing:
            raise RuntimeError(f"optimizer checkpoint {path!r} is incomplete: its index lists {missing}, which do not "
                               "exist; use a complete checkpoint")
        self.weight_map = {n: os.path.join(path, f) for n, f in meta["weight_map"].items()}
        groups = os.path.join(path, meta["param_groups"])
        self.extra = open_weights(groups, lambda: torch.load(groups, weights_only=True))

    def names(self) -> set[str]:
        return set(self.weight_map)

    def resolve(self, names: list[str]) -> str | None:
        """The saved name of a parameter known locally by `names` (tied weights: any alias)."""
        aliases = self.extra.get("aliases", {})
        for n in names:
            for c in (n, aliases.get(n)):
                if c in self.weight_map:
                    return c
        saved_alias = {a: s for a, s in aliases.items() if s in self.weight_map}
        return next((saved_alias[n] for n in names if n in saved_alias), None)

    def entry(self, name: str) -> dict:
        file = self.weight_map[name]
        if file not in self._files:
            self._files[file] = open_weights(file, lambda: torch.load(file, map_location="cpu", mmap=True,
                                                                      weights_only=True))
        return self._files[file][name]

    def __getitem__(self, name: str) -> dict:
        return self.entry(name)

    def __contains__(self, name) -> bool:
        return name in self.weight_map

    def __iter__(self):
        return iter(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)


def load_optimizer(optimizer, model: nn.Module, checkpoint: str) -> None:
    """Load a `save_optimizer` checkpoint (saved at any layout) into boosted `optimizer`, built on
    `model` (the user's model), in place. Names, groups and shapes are checked before anything
    changes. Call it on every rank (ZeRO writes the loaded masters back into the weights over dp)."""
    ckpt = OptimizerCheckpoint(checkpoint)
    names = ParamNames(model)
    key_of = {}
    for p in _trained(optimizer):
        saved = ckpt.resolve([names.key(p), *names.names(p)])
        if saved is None:
            raise KeyError(f"optimizer checkpoint {checkpoint!r} has no state for parameter {names.key(p)!r}")
        key_of[p] = saved
    optimizer.import_state(ckpt, key_of, ckpt.extra)


# -- the LR scheduler ------------------------------------------------------------------------------
def save_lr_scheduler(lr_scheduler, checkpoint: str, mesh=None) -> None:
    """Global rank 0 writes `lr_scheduler.state_dict()` to the file `checkpoint` (atomically); every
    rank waits and raises if it failed."""
    writer = CheckpointWriter(checkpoint, save_roles(mesh, main_only=True), shard=False, as_file=True,
                              write_file=lambda payload, path: _write_file(payload["state"], path),
                              what="save_lr_scheduler")
    writer.add("state", lr_scheduler.state_dict(), 0)
    writer.finish()


def load_lr_scheduler(lr_scheduler, checkpoint: str) -> None:
    recover(checkpoint)
    if not os.path.isfile(checkpoint):
        raise FileNotFoundError(f"lr scheduler checkpoint {checkpoint!r} does not exist")
    lr_scheduler.load_state_dict(torch.load(checkpoint, weights_only=True))
