"""The frozen reference model of a preference objective, on the policy's mesh.

Owns: `boost_reference` (the reference boosted by the policy's own booster with no optimizer: sharded like the
policy by the same plugin, so its vocab shards, sequence pieces and replicas line up with the policy's; frozen
before boost, so no gradient, no optimizer state, no ZeRO bucket and no DDP reducer is ever built for it; eval
mode), `adapters_disabled` (with LoRA the reference is the policy's own base weights: peft's
`disable_adapter()`, no second copy) and `check_reference` (a reference boosted with another layout than the
policy is refused: under pp its log-probs would sit on other ranks than the policy's loss, and no other
pairing of layouts is checked against one process), and `HostOffload` (`boost_reference(..., offload=True)`:
between uses the reference's parameters live in host memory, below).

Host offload. Every parameter's local storage (a tp shard, a pipeline stage's weights, FSDP2's padded flat shard
under ZeRO-3: whatever the layout, the bytes the parameter's storage holds on this rank) is copied once into a
host buffer (pinned on CUDA) and its device storage is resized to 0 bytes, FSDP2's own way of freeing an unsharded
parameter: every view (FSDP2's padded shard and the DTensor over it) keeps its shape and object, and nothing
re-points a module. Around each use the storages are allocated again and the host bytes copied in (on CUDA on a
side stream the compute stream waits for, no host sync), then freed again: the reference is frozen, so the host
copy stays the truth and nothing is copied back. A use is the boosted model's forward (a forward pre-hook and an
always-called forward hook) or, with pipeline stages, one `execute_pipeline` step (around the schedule's step
hooks, `PipelineSchedule.sharding`, which FSDP2's `StepSharding` also uses). Buffers (rotary tables) stay on the
device. Between uses the parameters hold no storage at all: touch the reference only through its forward or
`execute_pipeline` (a raw read of a weight faults on its empty storage, never returns stale numbers). Why not
torch's or accelerate's offload: FSDP2's CPUOffloadPolicy is chosen at `fully_shard` (the policy's plugin, shared
with the policy) and covers ZeRO-3 only; accelerate's hooks re-point parameters module by module and do not know
DTensor shards. Must not reach into a plugin's internals.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from meshboost.fsdp import reshard_all
from meshboost.plugins.hybrid_parallel import HybridParallelModule


def boost_reference(booster, model: torch.nn.Module, offload: bool = False):
    """`model` frozen and boosted by `booster` for inference only (the boosted wrapper, in eval mode). Call it
    with the same booster (the same plugin and layout) as the policy. offload: keep its parameters in host memory
    between uses (`HostOffload`: on the device only while its forward, or its pipeline step, runs)."""
    model.requires_grad_(False)
    boosted, *_ = booster.boost(model)
    boosted.eval()
    if offload:
        HostOffload(boosted).install()
    return boosted


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Inside: `model` (a boosted peft model) runs its base weights, no gradient; the adapters come back after."""
    from peft import PeftModel

    peft = next((m for m in model.modules() if isinstance(m, PeftModel)), None)
    if peft is None:
        raise TypeError(f"{type(model).__name__} holds no peft model: adapters_disabled is the LoRA reference "
                        "(pass a reference model built with boost_reference otherwise)")
    with peft.disable_adapter(), torch.no_grad():
        yield model


def check_reference(policy: torch.nn.Module, reference) -> None:
    """Refuse (alike on every rank: it reads the layouts only, before any collective) a reference whose
    log-probs would not line up with the policy's: boosted with other dims (dp, pp, tp, cp, ep), or, under
    pipeline stages, not boosted at all."""
    if reference is None or isinstance(reference, str):
        return
    mine = policy.mesh.dims if isinstance(policy, HybridParallelModule) else None
    theirs = reference.mesh.dims if isinstance(reference, HybridParallelModule) else None
    if mine is not None and theirs is not None and mine != theirs:
        raise ValueError(f"the reference model was boosted with {theirs}, the policy with {mine}: its log-probs would "
                         "not line up with the policy's rows and stages. Boost it with the policy's booster: "
                         "boost_reference(booster, reference_model)")
    if mine is not None and mine.pp > 1 and theirs is None:
        raise ValueError(f"with pp_size={mine.pp} the reference must be boosted like the policy (its log-probs are "
                         "read on the policy's last stage): boost_reference(booster, reference_model)")


@dataclass
class _Stored:
    """One parameter storage of the reference: a byte view over all of it (it keeps the storage itself, whatever
    re-points a module) and its bytes in host memory."""

    view: torch.Tensor           # uint8 [nbytes] over the storage (touched only while it is allocated)
    host: torch.Tensor           # uint8 [nbytes], pinned on CUDA


class HostOffload:
    """A frozen reference's parameters in host memory between uses (the module docstring says how). `on_device`:
    its storages are allocated and hold the weights now."""

    def __init__(self, model: torch.nn.Module):
        self._model = weakref.ref(model)        # the hooks live on the model: no cycle keeps a dropped one alive
        self.stored: list[_Stored] = []
        self.on_device = True
        self._stream = None

    @staticmethod
    def of(model: torch.nn.Module) -> "HostOffload | None":
        """The HostOffload `boost_reference(..., offload=True)` installed on `model`, or None."""
        step = getattr(getattr(model, "pipeline", None), "sharding", None)
        if isinstance(step, _StepOffload):
            return step.offload
        hooks = getattr(model, "_forward_pre_hooks", {}).values()
        return next((h.__self__ for h in hooks if isinstance(getattr(h, "__self__", None), HostOffload)), None)

    def install(self) -> None:
        """Hook the uses (the forward; with pipeline stages, each execute_pipeline step) and offload now."""
        model = self._model()
        schedule = getattr(model, "pipeline", None)
        if schedule is not None:          # the schedule runs the stage, not this wrapper's forward
            schedule.sharding = _StepOffload(self, schedule.sharding)
        else:
            model.register_forward_pre_hook(self._before)
            model.register_forward_hook(self._after, always_call=True)
        self.offload()

    @property
    def host_bytes(self) -> int:
        return sum(s.host.numel() for s in self.stored)

    def load(self) -> None:
        """Allocate every storage again and copy its host bytes in (CUDA: on a side stream the current one waits
        for, each storage marked as used by the current stream so that freeing it waits for its readers)."""
        if self.on_device:
            return
        stream = self._side_stream()
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for s in self.stored:
                s.view.untyped_storage().resize_(s.host.numel())
                s.view.copy_(s.host, non_blocking=stream is not None)
        if stream is not None:
            current = torch.cuda.current_stream(stream.device)
            current.wait_stream(stream)
            for s in self.stored:
                s.view.record_stream(current)
        self.on_device = True

    def offload(self) -> None:
        """Free every parameter storage on the device (FSDP2 resharded first); a storage not seen before (the first
        call, or one a module was re-pointed to) is copied to the host first. Nothing else is copied: frozen."""
        model = self._model()
        if model is None:
            return
        if self.on_device:
            self._adopt(model)
        for s in self.stored:
            s.view.untyped_storage().resize_(0)
        self.on_device = False

    def _adopt(self, model: torch.nn.Module) -> None:
        """`stored`: one entry per distinct storage of the model's parameters now (after FSDP2's reshard: its
        padded local shards), the host copy of a known one kept, of a new one made."""
        known = {s.view.untyped_storage().data_ptr(): s for s in self.stored}
        stored, seen = [], set()
        for storage in _parameter_storages(model):
            key = storage.data_ptr()
            if key in seen:
                continue
            seen.add(key)
            entry = known.get(key)
            if entry is None or entry.host.numel() != storage.nbytes():
                view = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
                host.copy_(view)
                entry = _Stored(view, host)
            stored.append(entry)
        self.stored = stored

    def _side_stream(self):
        if not self.stored or self.stored[0].view.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.stored[0].view.device)
        return self._stream

    def _before(self, module, args) -> None:
        self.load()

    def _after(self, module, args, output) -> None:
        self.offload()


def _parameter_storages(model: torch.nn.Module) -> list:
    """The storage under each parameter's local tensor (a DTensor's shard), FSDP2's units resharded first; a
    storage that cannot be resized (a memory-mapped file's) is replaced by a copy for a plain parameter."""
    reshard_all(model)
    out = []
    for name, p in model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p.detach()
        storage = local.untyped_storage()
        if storage.nbytes() and not storage.resizable():
            if isinstance(p, DTensor):
                raise RuntimeError(f"boost_reference(offload=True): the storage of {name} cannot be resized")
            p.data = p.detach().clone()
            storage = p.untyped_storage()
        if storage.nbytes():
            out.append(storage)
    return out


class _StepOffload:
    """The pipeline schedule's step hooks (`begin`/`finish`, `PipelineSchedule.sharding`) with the reference on the
    device through the step: loaded before the inner hooks' begin (FSDP2's `StepSharding`), offloaded after their
    finish (which reshards)."""

    def __init__(self, offload: HostOffload, inner):
        self.offload, self.inner = offload, inner

    def begin(self, training: bool) -> None:
        self.offload.load()
        if self.inner is not None:
            self.inner.begin(training)

    def finish(self, training: bool) -> None:
        if self.inner is not None:
            self.inner.finish(training)
        self.offload.offload()
