"""Save a (possibly tensor-parallel) model as a HuggingFace checkpoint that `from_pretrained` loads.

Owns: turning the model's state dict into full, unpadded tensors under the HF parameter names
(tp shards gathered with `gather_tensor`, which reads each parameter's own record), streaming
them file by file to the writing rank, and agreeing on success over every rank. The on-disk
layout lives in `hf_format.py`; collectives only through `shardformer/comm.py`.

Who does what (mesh order dp x pp x tp, tp innermost):
  * the tp ranks of data-parallel replica 0 take part in every gather (the other replicas hold
    identical weights and skip it);
  * the writer, global rank 0 (dp 0, pp 0, tp 0), writes the files (pp = 1);
  * finally every rank joins one all-reduce of an error flag, so a failed write raises on every
    rank and nobody walks on believing the checkpoint exists.
With pipeline stages, each stage's (dp 0, tp 0) rank writes the files of the parameters its stage
holds (numbered k-of-N across stages, agreed with one all-reduce) into one staging folder, and
rank 0 merges the stages' weight maps into the index before putting the folder in place; this
needs a file system every writer shares (one node, or a shared mount).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.booster.wrappers import ModelWrapper
from meshboost.checkpoint import hf_format
from meshboost.launch import get_current_device
from meshboost.shardformer import comm
from meshboost.shardformer.param_info import gather_tensor, get_tp_info


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's (sharded) HF model inside booster/DDP wrappers."""
    if isinstance(model, ModelWrapper):
        return model.unwrap()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.module
    return model


def full_shape_and_dtype(tensor: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """Shape the tensor has in the checkpoint (the unsharded, unpadded shape) and its dtype."""
    info = get_tp_info(tensor)
    return (tuple(info.full_shape) if info is not None else tuple(tensor.shape)), tensor.dtype


def checkpoint_entries(model: nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> local parameter/buffer, in state-dict order; tied tensors kept once (first name),
    as `from_pretrained` re-ties them."""
    entries, seen = {}, set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        entries[name] = tensor
    return entries


def _nbytes(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    shape, own_dtype = full_shape_and_dtype(tensor)
    dtype = dtype or own_dtype
    numel = 1
    for s in shape:
        numel *= s
    return numel * dtype.itemsize


def _full_tensor(tensor: torch.Tensor, masters: dict) -> torch.Tensor:
    """The full tensor to write: the fp32 master where mixed precision keeps one (nothing lost to
    rounding), else the parameter/buffer itself, gathered over tp by the parameter's record."""
    source = masters.get(tensor, tensor)
    full = gather_tensor(source.detach(), get_tp_info(tensor))
    return full.detach().to("cpu", copy=True).contiguous()


def _masters_of(boosted: nn.Module) -> dict:
    """fp32 masters of the optimizer boosted with `boosted` (collective under ZeRO: every rank)."""
    optimizer = getattr(boosted, "boosted_optimizer", None)
    full_masters = getattr(optimizer, "full_masters", None)
    return full_masters() if full_masters is not None else {}


@dataclass
class _Roles:
    gathers: bool          # joins the tp gathers of its stage (data-parallel replica 0)
    stage_writer: bool     # writes its stage's files (dp 0, tp 0 of the stage)
    main_writer: bool      # global rank 0: index, config, commit
    stage: int
    num_stages: int
    group: object          # every rank: the error flags are agreed over it
    dp_group: object = None  # ZeRO shards are gathered over it (None: nothing is partitioned)


def _roles(mesh) -> _Roles:
    if mesh is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return _Roles(True, rank == 0, rank == 0, 0, 1, dist.group.WORLD if dist.is_initialized() else None)
    writer = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return _Roles(mesh.dp_rank == 0, writer, mesh.global_rank == 0, mesh.pp_rank, mesh.pp_size, mesh.world_group,
                  mesh.dp_group)


def _any_failed(error: BaseException | None, group) -> bool:
    """Agree over `group` whether any rank failed (one MAX all-reduce; also a barrier)."""
    flag = torch.tensor([1.0 if error is not None else 0.0], device=get_current_device())
    if group is not None:
        comm.all_reduce(flag, group, op=dist.ReduceOp.MAX)
    return flag.item() > 0


def _raise(error: BaseException | None, checkpoint: str) -> None:
    if error is not None:
        raise error
    raise RuntimeError(f"save_model({checkpoint!r}) failed on a writing rank; see its error. Any existing "
                       "checkpoint there is unchanged.")


def _agree_on_layout(files, roles: _Roles, use_safetensors: bool, prefix: str | None) -> int:
    """Pipeline stages: number every stage's shard files globally (k-of-N across stages) and agree on
    a staging-folder token chosen by rank 0, with one all-reduce over every rank."""
    pp = roles.num_stages
    counts = torch.zeros(pp + 1, dtype=torch.float64, device=get_current_device())
    if roles.stage_writer:
        counts[roles.stage] = len(files)
    if roles.main_writer:
        counts[pp] = float(secrets.randbits(48))         # exact in float64
    comm.all_reduce(counts, roles.group)
    offset, total = int(counts[:roles.stage].sum().item()), int(counts[:pp].sum().item())
    hf_format.number_shards(files, use_safetensors, prefix, first=offset + 1, total=total)
    return int(counts[pp].item())


def save_model(model: nn.Module, checkpoint: str, mesh=None, shard: bool = False, gather_dtensor: bool = True,
               prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False) -> None:
    """Write `model` as an HF checkpoint at `checkpoint` (called on every rank of the mesh).

    shard=True: `checkpoint` is a folder with config.json, model-0000k-of-0000N.safetensors (or
    pytorch_model-...bin) files of at most `size_per_shard` MB and the HF index json.
    shard=False: a folder with config.json and one model.safetensors / pytorch_model.bin; or, when
    `checkpoint` ends in .safetensors/.bin/.pt/.pth, just that file (ColossalAI's behaviour).
    `prefix` is prepended to shard file names (the index still finds them). The target appears
    only once complete; an existing checkpoint there is replaced atomically.
    """
    # -- pure checks: the same answer on every rank, before any collective ----------------------
    if not gather_dtensor:
        raise NotImplementedError("save_model(gather_dtensor=False) (per-rank shard files) is not supported; "
                                  "use gather_dtensor=True to write a full HF checkpoint")
    if not isinstance(size_per_shard, (int, float)) or size_per_shard <= 0:
        raise ValueError(f"size_per_shard={size_per_shard!r} must be a positive number of megabytes")
    if prefix and not shard:
        raise ValueError(f"prefix={prefix!r} names shard files; it only applies with shard=True")
    roles = _roles(mesh)
    if roles.num_stages > 1 and not shard:
        raise NotImplementedError(f"save_model(shard=False) with pp_size={roles.num_stages}: each pipeline stage "
                                  "writes its own files; use shard=True")
    as_file = not shard and str(checkpoint).endswith(hf_format.SINGLE_FILE_SUFFIXES)
    if as_file:
        use_safetensors = str(checkpoint).endswith(".safetensors")
    masters = _masters_of(model)
    model = _unwrap(model)
    entries = checkpoint_entries(model)
    files = hf_format.plan_files({n: _nbytes(t, masters.get(t, t).dtype) for n, t in entries.items()}, shard,
                                 use_safetensors, size_per_shard, prefix)
    token = _agree_on_layout(files, roles, use_safetensors, prefix) if roles.num_stages > 1 else None

    # -- each stage writer stages its files ------------------------------------------------------
    error: BaseException | None = None
    target = None
    if roles.stage_writer:
        try:
            target = hf_format.AtomicTarget(checkpoint, is_file=as_file, token=token)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = e
    if roles.gathers:
        for f in files:
            # Every tp rank of replica 0 must join each gather, even after the writer failed,
            # so collectives stay matched; the writer just stops writing.
            tensors = {name: _full_tensor(entries[name], masters) for name in f.tensor_names}
            if roles.stage_writer and error is None:
                try:
                    path = target.path if as_file else os.path.join(target.path, f.name)
                    hf_format.write_weights(tensors, path, use_safetensors)
                except Exception as e:  # noqa: BLE001
                    error = e
            del tensors
    if roles.num_stages > 1:
        if roles.stage_writer and not roles.main_writer and error is None:
            try:
                hf_format.write_fragment(target.path, roles.stage, files)
            except Exception as e:  # noqa: BLE001
                error = e
        if _any_failed(error, roles.group):       # every stage has finished writing (a barrier)
            if target is not None:                # any stage writer may hold the shared folder
                target.abort()
            _any_failed(None, roles.group)        # nobody returns before the staging folder is gone
            _raise(error, checkpoint)

    # -- rank 0 completes the folder and puts it in place -----------------------------------------
    if roles.main_writer and error is None:
        try:
            if not as_file:
                if shard:
                    every = files + hf_format.read_fragments(target.path, range(1, roles.num_stages))
                    hf_format.write_index(target.path, every, use_safetensors)
                _save_config(model, target.path, torch.float32 if masters else None)
            target.commit()
        except Exception as e:  # noqa: BLE001
            error = e
    if roles.main_writer and error is not None and target is not None:
        target.abort()
    if _any_failed(error, roles.group):
        _raise(error, checkpoint)


def _save_config(model: nn.Module, folder: str, saved_dtype: torch.dtype | None = None) -> None:
    """config.json (and generation_config.json when the model generates), as save_pretrained writes
    them; `dtype` records what the weight files hold (fp32 when masters were saved)."""
    config = getattr(model, "config", None)
    if config is None:
        return
    config.architectures = [type(model).__name__]
    floating = [p.dtype for p in model.parameters() if p.is_floating_point()]
    if saved_dtype is not None or floating:
        config.dtype = str(saved_dtype or floating[0]).split(".")[1]
    config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(folder)
