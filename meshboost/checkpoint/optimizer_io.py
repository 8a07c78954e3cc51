"""Topology-free optimizer checkpoints: states keyed by parameter name, stored as full tensors.

Owns: turning a boosted optimizer's state (plain, MixedPrecisionOptimizer or ZeroOptimizer, at any
dp x pp x tp layout) into one entry per HF parameter name holding full, unpadded tensors, and the
reverse: slicing those entries back into whatever layout the loading optimizer has (tp shards with
vocab padding from each parameter's `TensorParallelInfo`; ZeRO: only this rank's bucket slices).

An entry is {"per_element": {key: full tensor}, "scalar": {key: value}, "master": full fp32 tensor
(only when mixed precision / ZeRO keep masters apart from the weights)}. Adam's `exp_avg` is
per-element, its `step` scalar (stored once per parameter). Next to the entries: the param groups
(hyperparameters, params listed by name), the loss-scaler state and the names tied weights go by.

On disk (written atomically through `hf_format.AtomicTarget`):
  shard=False: one torch file at `checkpoint` {"format", "state": {name: entry}, "extra": {...}}.
  shard=True:  a folder: optimizer-0000k-of-0000N.bin ({name: entry}), optimizer.groups.bin (the
               "extra" part) and optimizer.index.json {"format", "weight_map": name -> file,
               "param_groups": "optimizer.groups.bin"}. Pipeline stages (shard=True only) each
               write their own files (their dp 0 / tp 0 rank) into one staging folder; global rank
               0 merges the stages' parts into the index and puts the folder in place.
Who gathers: ZeRO shards are all-gathered over dp (every dp rank), tp shards over tp (dp replica 0
only). Collectives only through `shardformer/comm.py`. Loading reads files memory-mapped and
never communicates except ZeRO's write-back of loaded masters into the working weights.
"""

from __future__ import annotations

import json
import os
import secrets

import torch
import torch.nn as nn

from meshboost.booster.wrappers import OptimizerWrapper
from meshboost.checkpoint import hf_format
from meshboost.checkpoint.load import slice_shard
from meshboost.checkpoint.model_io import _any_failed, _roles, _unwrap
from meshboost.launch import get_current_device
from meshboost.optim.mixed_precision import MixedPrecisionOptimizer
from meshboost.optim.zero import ZeroOptimizer
from meshboost.shardformer import comm
from meshboost.shardformer.param_info import TensorParallelInfo, gather_tensor, get_tp_info

FORMAT = "meshboost-optimizer-v1"
INDEX_NAME = "optimizer.index.json"
GROUPS_NAME = "optimizer.groups.bin"


# -- what the optimizer holds ------------------------------------------------------------------
def _inner(optimizer):
    return optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer


def _group_params(optimizer) -> list[list[torch.Tensor]]:
    """The working (model) parameters of each param group."""
    if isinstance(optimizer, MixedPrecisionOptimizer):
        return optimizer.working_params
    return [list(g["params"]) for g in _inner(optimizer).param_groups]


def _names(model: nn.Module) -> tuple[dict[int, str], dict[str, list[str]]]:
    """id(param) -> its name in the checkpoint, and that name -> every name it goes by.

    A weight tied by the model (transformers 5: `_tied_weights_keys = {target: source}`, e.g. the LM
    head tied to the embedding) is saved under its source name even on a pipeline stage that holds
    only the target, so every stage and layout agrees on one key."""
    tied = getattr(model, "_tied_weights_keys", None)
    tied = tied if isinstance(tied, dict) else {}
    first, aliases = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        key = first.setdefault(id(p), tied.get(name, name))
        names = aliases.setdefault(key, [key])
        if name not in names:
            names.append(name)
    return first, aliases


def _per_element(value, master: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == master.shape


def _full(local: torch.Tensor, info: TensorParallelInfo | None, gathers: bool) -> torch.Tensor | None:
    if not gathers:
        return None
    return gather_tensor(local.detach(), info).detach().to("cpu", copy=True).contiguous()


def _entries(optimizer, model: nn.Module, gathers: bool, dp_group):
    """Yield (name, entry) in the same order on every rank of a stage, joining every collective.
    `gathers`: this rank joins the tp gathers (dp replica 0); entries of other ranks are None."""
    inner = _inner(optimizer)
    first, _ = _names(model)
    if isinstance(optimizer, ZeroOptimizer):
        for b in optimizer.buckets:
            state = inner.state.get(b.master, {})
            flat = {k: comm.all_gather(v.detach(), dp_group, dim=0) for k, v in sorted(state.items())
                    if _per_element(v, b.master)}
            flat["__master__"] = comm.all_gather(b.master.detach(), dp_group, dim=0)
            for p, off in zip(b.params, b.offsets):
                info = get_tp_info(p)
                full = {k: _full(v[off:off + p.numel()].view(p.shape), info, gathers) for k, v in flat.items()}
                master = full.pop("__master__")
                yield first[id(p)], gathers and {
                    "per_element": full, "master": master,
                    "scalar": {k: _copy(v) for k, v in state.items() if not _per_element(v, b.master)}}
        return
    master_of = getattr(optimizer, "master_of", {})
    for params in _group_params(optimizer):
        for p in params:
            m = master_of.get(p, p)
            state = inner.state.get(m, {})
            info = get_tp_info(p)
            entry = {"per_element": {k: _full(v, info, gathers) for k, v in sorted(state.items())
                                     if _per_element(v, m)},
                     "scalar": {k: _copy(v) for k, v in state.items() if not _per_element(v, m)}}
            if m is not p:
                entry["master"] = _full(m, info, gathers)
            yield first[id(p)], gathers and entry


def _copy(value):
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def _extra(optimizer, model: nn.Module) -> dict:
    """Param groups (params by name), loss-scaler state and tied-weight aliases."""
    first, aliases = _names(model)
    groups = []
    for group, params in zip(_inner(optimizer).param_groups, _group_params(optimizer)):
        saved = {k: _copy(v) for k, v in group.items() if k != "params"}
        saved["params"] = [first[id(p)] for p in params]
        groups.append(saved)
    extra = {"param_groups": groups, "aliases": {a: n for n, names in aliases.items() for a in names}}
    scaler = getattr(optimizer, "scaler", None)
    if scaler is not None:
        extra["loss_scaler"] = scaler.state_dict()
    return extra


# -- save ----------------------------------------------------------------------------------------
def _agree(values: list[float], group) -> list[float]:
    """Sum `values` over every rank (one all-reduce; also a barrier)."""
    t = torch.tensor(values, dtype=torch.float64, device=get_current_device())
    if group is not None:
        comm.all_reduce(t, group)
    return t.tolist()


def _write_file(obj, path: str) -> None:
    """Write one torch file (tests replace this to simulate a crash)."""
    torch.save(obj, path)


def _shard_name(prefix: str | None, k: int, total: int) -> str:
    return f"{prefix + '-' if prefix else ''}optimizer-{k:05d}-of-{total:05d}.bin"


def _nbytes(entry: dict) -> int:
    tensors = list(entry["per_element"].values()) + ([entry["master"]] if "master" in entry else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def save_optimizer(optimizer, model: nn.Module, checkpoint: str, shard: bool = False, size_per_shard: float = 1024,
                   prefix: str | None = None, mesh=None) -> None:
    """Write the state of boosted `optimizer` (built on boosted `model`) at `checkpoint`; call it on
    every rank. shard=False: one file. shard=True: a folder of files of at most `size_per_shard` MB
    plus the index. The result loads at any other layout (`load_optimizer`)."""
    if not isinstance(size_per_shard, (int, float)) or size_per_shard <= 0:
        raise ValueError(f"size_per_shard={size_per_shard!r} must be a positive number of megabytes")
    if prefix and not shard:
        raise ValueError(f"prefix={prefix!r} names shard files; it only applies with shard=True")
    if mesh is None:
        mesh = getattr(optimizer, "mesh", None)
    if mesh is None:
        mesh = getattr(model, "mesh", None)
    r = _roles(mesh)
    if r.num_stages > 1 and not shard:
        raise NotImplementedError(f"save_optimizer(shard=False) with pp_size={r.num_stages}: each pipeline stage "
                                  "writes its own files; use shard=True")
    model = _unwrap(model)
    extra = _extra(optimizer, model)
    token = None
    if r.num_stages > 1:                          # one staging folder for every stage, named by rank 0
        token = int(_agree([float(secrets.randbits(48)) if r.main_writer else 0.0], r.group)[0])
    error, target = None, None
    if r.stage_writer:
        try:
            target = hf_format.AtomicTarget(checkpoint, is_file=not shard, token=token)
        except Exception as e:  # noqa: BLE001 - agreed on every rank below
            error = e
    limit = size_per_shard * 1024 * 1024
    parts: list[tuple[str, list[str], int]] = []      # (staged name, entry names, bytes)
    pending, pending_bytes, whole = {}, 0, {}

    def flush():
        nonlocal pending, pending_bytes, error
        if pending and error is None:
            name = f".part-{r.stage}-{len(parts)}.bin"
            try:
                _write_file(pending, os.path.join(target.path, name))
            except Exception as e:  # noqa: BLE001
                error = e
            parts.append((name, list(pending), pending_bytes))
        pending, pending_bytes = {}, 0

    for name, entry in _entries(optimizer, model, r.gathers, r.dp_group):
        if not r.stage_writer:
            continue
        if not shard:
            whole[name] = entry
            continue
        size = _nbytes(entry)
        if pending and pending_bytes + size > limit:
            flush()
        pending[name] = entry
        pending_bytes += size
    if r.stage_writer and shard:
        flush()
    if r.stage_writer and not shard and error is None:
        try:
            _write_file({"format": FORMAT, "state": whole, "extra": extra}, target.path)
        except Exception as e:  # noqa: BLE001
            error = e
    if shard:
        counts = [0.0] * (r.num_stages + 1)
        if r.stage_writer:
            counts[r.stage] = float(len(parts))
        counts[-1] = 1.0 if error is not None else 0.0
        counts = _agree(counts, r.group)
        if counts[-1] == 0 and r.stage_writer:
            first, total = int(sum(counts[:r.stage])), int(sum(counts[:r.num_stages]))
            try:
                weight_map, total_size = {}, 0
                for k, (staged, names, nbytes) in enumerate(parts, start=first + 1):
                    final = _shard_name(prefix, k, total)
                    os.replace(os.path.join(target.path, staged), os.path.join(target.path, final))
                    weight_map.update({n: final for n in names})
                    total_size += nbytes
                torch.save({"weight_map": weight_map, "total_size": total_size, "extra": extra},
                           os.path.join(target.path, f".stage{r.stage}.optim"))
            except Exception as e:  # noqa: BLE001
                error = e
        if _any_failed(error, r.group) or counts[-1]:
            _abort(target, r, error, checkpoint)
    if r.main_writer and error is None:
        try:
            if shard:
                _merge_stages(target.path, r.num_stages)
            target.commit()
        except Exception as e:  # noqa: BLE001
            error = e
    if _any_failed(error, r.group):
        _abort(target, r, error, checkpoint)


def _abort(target, r, error, checkpoint):
    if r.main_writer and target is not None:
        target.abort()
    # Every rank reaches here together; wait until the staging folder is gone before any returns.
    _agree([0.0], r.group)
    if error is not None:
        raise error
    raise RuntimeError(f"save_optimizer({checkpoint!r}) failed on another rank; see its error. Any existing "
                       "checkpoint there is unchanged.")


def _merge_stages(folder: str, stages: int) -> None:
    """Merge the stages' weight maps and param groups into the index (rank 0)."""
    weight_map, total, extra = {}, 0, None
    for s in range(stages):
        path = os.path.join(folder, f".stage{s}.optim")
        part = torch.load(path, weights_only=True)
        os.remove(path)
        weight_map.update(part["weight_map"])
        total += part["total_size"]
        if extra is None:
            extra = part["extra"]
            continue
        extra["aliases"].update(part["extra"]["aliases"])
        for mine, theirs in zip(extra["param_groups"], part["extra"]["param_groups"]):
            mine["params"] += [n for n in theirs["params"] if n not in mine["params"]]
    torch.save(extra, os.path.join(folder, GROUPS_NAME))
    with open(os.path.join(folder, INDEX_NAME), "w", encoding="utf-8") as fh:
        json.dump({"format": FORMAT, "metadata": {"total_size": total}, "weight_map": weight_map,
                   "param_groups": GROUPS_NAME}, fh, indent=2, sort_keys=True)


# -- load ----------------------------------------------------------------------------------------
class OptimizerCheckpoint:
    """The entries of a saved optimizer (memory-mapped): `entry(name)`, `extra`, `names()`."""

    def __init__(self, path: str):
        self._files: dict[str, dict] = {}
        if os.path.isfile(path):
            blob = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            if not isinstance(blob, dict) or blob.get("format") != FORMAT:
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
        self.extra = torch.load(os.path.join(path, meta["param_groups"]), weights_only=True)

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
            self._files[file] = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
        return self._files[file][name]


def _local(full: torch.Tensor, info: TensorParallelInfo | None, name: str) -> torch.Tensor:
    """This rank's tp shard (zero-padded like the parameter) of a full saved tensor."""
    if info is None:
        return full
    return slice_shard(full.__getitem__, tuple(full.shape), info, f"optimizer state of {name!r}")


@torch.no_grad()
def load_optimizer(optimizer, model: nn.Module, checkpoint: str) -> None:
    """Load a `save_optimizer` checkpoint (saved at any layout) into boosted `optimizer`, in place.
    Call it on every rank (ZeRO writes the loaded masters back into the weights over dp)."""
    ckpt = OptimizerCheckpoint(checkpoint)
    model = _unwrap(model)
    inner = _inner(optimizer)
    first, aliases = _names(model)

    def entry_of(p):
        name = first[id(p)]
        saved = ckpt.resolve(aliases[name])
        if saved is None:
            raise KeyError(f"optimizer checkpoint {checkpoint!r} has no state for parameter {name!r}")
        return name, ckpt.entry(saved)

    saved_groups = ckpt.extra["param_groups"]
    if len(saved_groups) != len(inner.param_groups):
        raise ValueError(f"optimizer checkpoint has {len(saved_groups)} param groups, this optimizer "
                         f"{len(inner.param_groups)}; build the optimizer with the same groups")
    for i, (group, params, saved) in enumerate(zip(inner.param_groups, _group_params(optimizer), saved_groups)):
        known = set(saved["params"])
        stray = [first[id(p)] for p in params if ckpt.resolve(aliases[first[id(p)]]) not in known]
        if stray:
            raise ValueError(f"param group {i}: parameters {stray[:5]} are not in the saved group {i}")
        group.update({k: v for k, v in saved.items() if k != "params"})

    device = get_current_device()
    if isinstance(optimizer, ZeroOptimizer):
        for b in optimizer.buckets:
            entries = [entry_of(p) for p in b.params]
            state = {k: torch.zeros_like(b.master) for k in entries[0][1]["per_element"]}
            state.update({k: _copy(v) for k, v in entries[0][1]["scalar"].items()})
            masters = all("master" in e for _, e in entries)
            for (name, e), (p, start, end, s) in zip(entries, _owned(b)):
                info = get_tp_info(p)
                for k, full in e["per_element"].items():
                    state[k][s:s + end - start] = _local(full, info, name).reshape(-1)[start:end]
                src = _local(e["master"], info, name) if masters else p.detach()
                b.master.detach()[s:s + end - start] = src.reshape(-1)[start:end].float()
            inner.state[b.master] = {k: _to(v, device) for k, v in state.items()}
        optimizer._write_back()                      # loaded masters -> working weights (all-gather over dp)
        _load_scaler(optimizer, ckpt)
        return
    master_of = getattr(optimizer, "master_of", {})
    wrote_masters = False
    for params in _group_params(optimizer):
        for p in params:
            name, e = entry_of(p)
            m = master_of.get(p, p)
            info = get_tp_info(p)
            state = {k: _local(v, info, name).to(m.device, copy=True) for k, v in e["per_element"].items()}
            state.update({k: _copy(v) for k, v in e["scalar"].items()})
            inner.state[m] = {k: _to(v, device) for k, v in state.items()}
            if m is not p:
                m.copy_(_local(e["master"], info, name) if "master" in e else p.detach().float())
                wrote_masters = True
    if wrote_masters:
        optimizer._write_back()
    _load_scaler(optimizer, ckpt)


def _owned(b):
    """Every param of bucket `b` with its owned slice (empty slices too, to zip with b.params)."""
    lo, hi = b.dp_rank * b.shard_size, (b.dp_rank + 1) * b.shard_size
    for p, off in zip(b.params, b.offsets):
        a, e = max(lo, off), min(hi, off + p.numel())
        yield (p, a - off, e - off, a - lo) if a < e else (p, 0, 0, 0)


def _to(value, device):
    # Adam keeps `step` on the CPU unless capturable/fused; keep scalars where they were saved.
    return value.to(device) if torch.is_tensor(value) and value.dim() > 0 else value


def _load_scaler(optimizer, ckpt: OptimizerCheckpoint) -> None:
    scaler, state = getattr(optimizer, "scaler", None), ckpt.extra.get("loss_scaler")
    if scaler is not None and state is not None:
        scaler.load_state_dict(state)
