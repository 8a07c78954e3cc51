"""Booster: the user-facing dispatcher. Owns nothing parallel itself: every call goes to the
plugin, whose names and signatures follow ColossalAI's Booster so scripts port by changing
imports."""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.optim import Optimizer

from meshboost.booster import checkpoint_io, lora
from meshboost.booster.mixed_precision import (
    AutocastModel, apply_mixed_precision, check_mixed_precision, scaler_settings)
from meshboost.booster.checkpoint_view import CheckpointIO
from meshboost.booster.plugin_base import Plugin
from meshboost.booster.wrappers import ModelWrapper
from meshboost.checkpoint import load_lr_scheduler, save_lr_scheduler
from meshboost.checkpoint.async_save import AsyncSaver
from meshboost.checkpoint.export import ExportState
from meshboost.distributed import ParallelMesh
from meshboost.distributed.agreement import agree_model
from meshboost.distributed.launch import get_current_device
from meshboost.lazy import LazyInitContext, lazy_seed
from meshboost.optim import OptimizerWrapper


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")


def _check_threads(num_threads) -> None:
    if not isinstance(num_threads, int) or isinstance(num_threads, bool) or num_threads < 1:
        raise ValueError(f"num_threads={num_threads!r} must be a positive integer")


def _check_optimizer_trains(model: nn.Module, optimizer) -> None:
    """The optimizer must step this model's parameters (checked on every rank, before anything)."""
    inner = optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in inner.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} parameters that are not {type(model).__name__}'s (was it "
                         "built on another model, or on a copy?); build it on the model you boost: "
                         "torch.optim.AdamW(model.parameters(), ...)")


class Booster:
    """Boost a model, optimizer, criterion, dataloader and scheduler with a parallel `plugin`.

    >>> booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    >>> model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, criterion)
    """

    def __init__(self, plugin: Plugin | None = None, mixed_precision=None, device: str | None = None):
        # ColossalAI's Booster(device=...): the device always comes from the environment here
        # (cuda:LOCAL_RANK under CUDA, else the CPU); a different one is refused, not ignored.
        if device is not None and torch.device(device).type != get_current_device().type:
            raise ValueError(f"Booster(device={device!r}): this process runs on {get_current_device()} (chosen from "
                             "the environment by launch_from_torch); drop device= or pass that device type")
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be a meshboost Plugin, got {type(plugin).__name__}")
        # autocast (+ fp16 loss scaling) for plugins without a precision of their own, e.g. TorchDDPPlugin
        self.amp_dtype = check_mixed_precision(mixed_precision, plugin)
        self.mixed_precision = mixed_precision
        self.plugin = plugin
        # delta weight export: per model, what its last export sent (dropped with the model)
        self._export_states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._saver: AsyncSaver | None = None     # asynchronous training-checkpoint saves (the first creates it)

    def boost(self, model: nn.Module, optimizer: Optimizer | None = None, criterion: Callable | None = None,
              dataloader=None, lr_scheduler=None) -> tuple:
        """Return (model, optimizer, criterion, dataloader, lr_scheduler), made parallel by the plugin."""
        if isinstance(model, ModelWrapper):
            raise RuntimeError("this model was already boosted; pass the original model to boost() once")
        if optimizer is not None:
            _check_optimizer_trains(model, optimizer)
        if self.plugin is not None:      # collective, after the pure checks: every rank built the same model
            agree_model(model, f"{type(self.plugin).__name__} boost")
        if lazy_seed(model) is not None and not getattr(self.plugin, "materializes_lazy_models", False):
            # built under LazyInitContext: a plugin that does not shard it first gets it whole
            device = self.mesh.device if self.mesh is not None else get_current_device()
            LazyInitContext.materialize(model, device)
        if self.plugin is None:
            out = (ModelWrapper(model), OptimizerWrapper(optimizer) if optimizer is not None else None,
                   criterion, dataloader, lr_scheduler)
        else:
            out = self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)
        if self.amp_dtype is not None:
            device = self.mesh.device if self.mesh is not None else get_current_device()
            out = (*apply_mixed_precision(out[0], out[1], self.amp_dtype, device.type,
                                          **scaler_settings(self.mixed_precision)), *out[2:])
        if out[1] is not None:
            # Checkpoints need the pair: optimizer states are keyed by the model's parameter names, and
            # loading a model must refresh the optimizer's fp32 masters.
            out[0].boosted_optimizer, out[1].boosted_model = out[1], out[0]
        return out

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """Backward through the boosted optimizer (which scales the loss under fp16)."""
        if not isinstance(optimizer, OptimizerWrapper):
            raise TypeError("booster.backward needs the optimizer returned by booster.boost(...)")
        if self.plugin is None:
            optimizer.backward(loss)
        else:
            self.plugin.backward(loss, optimizer)

    def no_sync(self, model: nn.Module | None = None, optimizer=None) -> contextlib.AbstractContextManager:
        """Accumulate gradients without data-parallel reduction inside the block."""
        if self.plugin is None:
            return contextlib.nullcontext()
        if isinstance(model, AutocastModel):
            model = model.module
        return self.plugin.no_sync(model, optimizer)

    def execute_pipeline(self, data_iter: Iterator, model, criterion, optimizer=None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict:
        """Run one pipeline-parallel step over the micro-batches of `data_iter` (pp_size > 1)."""
        if self.plugin is None:
            raise RuntimeError("execute_pipeline needs a plugin with pipeline parallelism")
        return self.plugin.execute_pipeline(data_iter, model, criterion, optimizer, return_loss, return_outputs)

    def enable_lora(self, model: nn.Module, pretrained_dir: str | None = None, lora_config=None,
                    bnb_quantization_config=None, quantize=False) -> nn.Module:
        """Wrap `model` with HuggingFace peft LoRA adapters, before `boost`: new ones from
        `lora_config` (a `peft.LoraConfig`), or trainable ones loaded from `pretrained_dir` (a peft
        folder). Boost the returned model; build the optimizer on its parameters (peft freezes the
        base weights). Plugins: TorchDDPPlugin, LowLevelZeroPlugin, HybridParallelPlugin(tp_size=1,
        pp_size=1), as ColossalAI. quantize=True, "nf4" or a `QuantConfig`: QLoRA, the adapted linears' frozen bases in NF4 (torchao; bitsandbytes' configs are refused)."""
        return lora.enable_lora(self.plugin, model, pretrained_dir, lora_config, bnb_quantization_config, quantize)

    def save_lora_as_pretrained(self, model: nn.Module, checkpoint: str, use_safetensors: bool = False) -> None:
        """Save only the LoRA adapters of boosted `model` as a peft folder (`adapter_config.json` and the
        adapter weights: fp32 masters when the optimizer keeps them) that `PeftModel.from_pretrained`
        and `enable_lora(pretrained_dir=...)` load. Call on every rank."""
        _check_flag("use_safetensors", use_safetensors)
        lora.save_lora(model, checkpoint, use_safetensors, self.mesh)

    # -- checkpoints (ColossalAI's signatures). The layout is the plugin's mesh (no plugin: one
    # replicated model, rank 0 writes); the work is in meshboost/checkpoint. Call on every rank. --
    @property
    def mesh(self) -> ParallelMesh | None:
        return self.plugin.mesh if self.plugin is not None else None

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """ColossalAI's `booster.checkpoint_io`: this booster's save/load calls under CheckpointIO's names."""
        return CheckpointIO(self)

    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False,
                   use_async: bool = False) -> None:
        """Save `model` (boosted or not) as a HuggingFace checkpoint that `from_pretrained` loads.
        shard=True: a folder with size-capped weight files and the HF index json; shard=False: one
        weights file (plus config.json unless `checkpoint` is a file name). fp32 masters are saved
        when mixed precision keeps them. use_async (ColossalAI's keyword): accepted; meshboost writes
        before returning either way, so the files are complete when the call ends."""
        _check_flag("use_async", use_async)
        checkpoint_io.save_boosted_model(model, checkpoint, self.mesh, shard=shard, gather_dtensor=gather_dtensor,
                                         prefix=prefix, size_per_shard=size_per_shard,
                                         use_safetensors=use_safetensors)

    def export_weights(self, model: nn.Module, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None,
                       delta: bool = False, lora: str = "merged", timeout: float | None = None):
        """Stream boosted `model`'s full HF tensors as (hf_name, tensor) pairs, bucket by bucket, for an inference
        engine's `load_weights(iterable)` (or `meshboost.checkpoint.export.load_into(hf_model, pairs)`): the
        tensors `save_model` writes, cast to `dtype` (default: the dtype the weights hold). Call on every rank and
        iterate to the end: global rank 0 receives every stage's pairs, the other ranks yield nothing. A bucket
        (`bucket_bytes`, at least the largest tensor) is what each rank holds beyond the model. delta: only the
        tensors that changed since this model's last complete export (each rank keeps a copy of its shards).
        A LoRA model: lora="merged" (peft's merge, base names) or "adapters" (peft's adapter names). `timeout`
        seconds for every rank to call it (default: the process group's). See docs/post_training.md."""
        _check_flag("delta", delta)
        state = None
        if delta:
            state = self._export_states.setdefault(model, ExportState())
        return checkpoint_io.export_boosted_weights(model, self.mesh, state, lora, bucket_bytes=bucket_bytes,
                                                    dtype=dtype, timeout=timeout)

    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True, low_cpu_mem_mode: bool = True,
                   num_threads: int = 1) -> None:
        """Load an HF folder/file (ours or `save_pretrained`'s) into boosted `model` at its layout; each rank
        reads only its slices. Refreshes the fp32 masters of the optimizer boosted with it.
        low_cpu_mem_mode, num_threads (ColossalAI's keywords): accepted; meshboost always reads lazily
        (safetensors memory-maps; each rank copies only its slices), on the calling thread."""
        _check_flag("low_cpu_mem_mode", low_cpu_mem_mode)
        _check_threads(num_threads)
        checkpoint_io.load_boosted_model(model, checkpoint, strict, self.mesh)

    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                       prefix: str | None = None, size_per_shard: int = 1024, use_async: bool = False) -> None:
        """Save optimizer states keyed by parameter name as full tensors (loads at any layout). shard=False:
        one file (over pipeline stages too); shard=True: a folder with an index. use_async: as in
        save_model (written before returning)."""
        _check_flag("use_async", use_async)
        checkpoint_io.save_boosted_optimizer(optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard,
                                             self.mesh)

    def load_optimizer(self, optimizer, checkpoint: str, low_cpu_mem_mode: bool = True, num_threads: int = 1) -> None:
        """Load a `save_optimizer` checkpoint saved at any layout. Load the model first. low_cpu_mem_mode,
        num_threads: as in load_model."""
        _check_flag("low_cpu_mem_mode", low_cpu_mem_mode)
        _check_threads(num_threads)
        checkpoint_io.load_boosted_optimizer(optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        """Rank 0 writes the scheduler's state_dict to the file `checkpoint`."""
        save_lr_scheduler(lr_scheduler, checkpoint, self.mesh)

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        load_lr_scheduler(lr_scheduler, checkpoint)

    # -- training checkpoints: one step folder, committed atomically, the last `keep_last` kept --------
    def save_checkpoint(self, checkpoint: str, model: nn.Module, optimizer=None, lr_scheduler=None, dataloader=None,
                        step: int = 0, keep_last: int = 3, extra: dict | None = None, asynchronous: bool = False,
                        if_busy: str = "wait") -> str | None:
        """Save everything a run needs to resume after step `step` (model, optimizer with its loss scaler,
        LR scheduler, every rank's random generators, the `plugin.prepare_dataloader` loader's position
        and your JSON-able `extra`) as `checkpoint/step-<step>`, then point `checkpoint/latest` at it
        atomically: a crash at any moment leaves `latest` naming a complete step. Call on every rank.
        asynchronous: return once the state is staged in host memory; the files are written and the step
        committed in a background thread (`wait_for_checkpoint()` blocks for it and raises its failure,
        as does the next save). A save still in flight is waited for first (if_busy="wait") or this step
        is skipped with a warning (if_busy="skip": returns None)."""
        if asynchronous and self._saver is None:
            self._saver = AsyncSaver()
        if not asynchronous:
            self.wait_for_checkpoint()             # one save at a time: the one in flight first
        return checkpoint_io.save_checkpoint(checkpoint, step, model, optimizer, lr_scheduler, dataloader, self.mesh,
                                             keep_last, extra, saver=self._saver if asynchronous else None,
                                             if_busy=if_busy)

    def wait_for_checkpoint(self) -> None:
        """Block until the asynchronous save in flight (if any) is committed; raise its failure (on every
        rank). Call it at the end of training, before the process group is destroyed."""
        if self._saver is not None:
            self._saver.wait()

    def load_checkpoint(self, checkpoint: str, model: nn.Module, optimizer=None, lr_scheduler=None,
                        dataloader=None, verify: bool = True) -> dict | None:
        """Restore the step `checkpoint/latest` names into the boosted objects (weights and optimizer at any
        layout; random generators and data position when the mesh is the one that saved). Returns the
        step's meta ({"step": ..., "extra": ...}) or None when there is no checkpoint yet, so a script can
        always call it at start (elastic restarts included). Call on every rank. verify: check every file
        against the size and crc32 its step recorded first (off: for very large checkpoints; the work is
        shared by the ranks, at about 1.5 GB/s each)."""
        self.wait_for_checkpoint()                 # the step in flight may be the one to load
        return checkpoint_io.load_checkpoint(checkpoint, model, optimizer, lr_scheduler, dataloader, self.mesh,
                                             verify)
