"""Activation offload: the tensors each transformer block saves for its backward kept in host memory.

Owns: `OffloadConfig` (the switch's one knob, `min_bytes`), `OffloadStats` (what was moved, counted) and
`install_offload(blocks, config, device)`: a forward pre-hook and an always-called forward hook on each
block that enter and leave torch's `saved_tensors_hooks` around the block's call. Must not fork a forward
or pick the blocks: the plugin hands the blocks its pipeline layout lists (the same the compile and the
stages use).

What is moved. Every tensor autograd saves inside a block, of at least `min_bytes`, dense (its strides
kept exactly: the backward's kernels see the same layout, so the same bits), a plain `torch.Tensor` (a
subclass, NF4 or float8, stays), and never a parameter or a view of one (weights are not activations;
the hooks see `weight.t()` for every linear). The same data saved twice in one block (a norm's output read
by the q, k and v projections) is copied once: the block's originals are held until its forward ends, so a
storage address seen twice in it is the same data (its version counter checked too).

Checkpointing. transformers 5 checkpoints a layer's `forward`, inside the module's hooks, so this context
is outside the checkpoint: the non-reentrant checkpoint saves the block's positional inputs (its
`_NoopSaveInputs`) through these hooks, and everything inside through its own, innermost, ones. With
checkpointing on, only the checkpointed inputs are offloaded; the recompute in the backward runs outside
any block's call, its tensors never come here. The reentrant form saves its inputs with `save_for_backward`
inside these hooks too.

The devices. CUDA: a pinned host buffer, copied on a side stream after it waited on the compute stream
(the source kept by `record_stream` until the copy ran); the backward's first unpack in a block prefetches
the previous block's tensors (the next to run backward) on the side stream, an event the compute stream
waits on before use. CPU: host and device are one memory, so the "offload" is a copy into a separate host
tensor, handed back by the unpack: the mechanics (what is packed, counted, prefetched, returned) run and
are tested; the saving is the GPU's (a CPU peak cannot drop, the copy lives in the same memory).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshboost.shardformer.shard_config import switch_config


@dataclass
class OffloadConfig:
    """Activation offload to host (`HybridParallelConfig(activation_offload=True)` takes the defaults)."""

    # saved tensors smaller than this stay on the device (a copy's fixed cost outweighs their bytes)
    min_bytes: int = 1 << 16

    def __post_init__(self):
        if not isinstance(self.min_bytes, int) or isinstance(self.min_bytes, bool) or self.min_bytes < 0:
            raise ValueError(f"OffloadConfig(min_bytes={self.min_bytes!r}) must be a non-negative integer of bytes")

    @classmethod
    def of(cls, value) -> "OffloadConfig | None":
        """The config for `activation_offload=`: True the defaults, False/None off, a config itself."""
        return switch_config(cls, value, "activation_offload")


@dataclass
class OffloadStats:
    """Counts since the last `reset()`: bytes and tensors copied to host, and what was left or reused."""

    packed_bytes: int = 0        # host bytes written (one copy per distinct saved tensor)
    packed: int = 0              # distinct tensors moved to host
    reused: int = 0              # saves of data already moved in the same block call
    kept_parameters: int = 0     # parameters and views of them, left where they are
    kept_small: int = 0          # under min_bytes, or not dense, or a tensor subclass
    unpacked: int = 0            # tensors handed back to the backward
    prefetched: int = 0          # of those, brought back ahead by the previous block's backward

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)


class _Record:
    """One tensor's host copy and, on the way back, its device copy."""

    __slots__ = ("host", "copied", "prefetched", "back")

    def __init__(self, host: torch.Tensor, copied):
        self.host, self.copied = host, copied   # copied: the side stream's event (CUDA) or None
        self.prefetched = None                  # (device tensor, event) once prefetched
        self.back = None                        # weakref to the last device copy handed out


class _Frame:
    """The records of one call of one block; `previous` the block called before it (a weakref)."""

    __slots__ = ("records", "previous", "held", "started", "__weakref__")

    def __init__(self, previous):
        self.records: list[_Record] = []
        self.previous = previous
        self.held: dict = {}         # storage key -> (original, record), while the block's forward runs
        self.started = False         # its backward has unpacked: the previous frame was prefetched


def is_non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its extent exactly once (a permutation of a contiguous layout), so a
    fresh tensor of its strides holds it whole: expanded (stride 0) and gapped views are not."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


class ActivationOffloader:
    """The hooks of one model's blocks and their counters (`stats`)."""

    def __init__(self, config: OffloadConfig, device: torch.device):
        self.config, self.device = config, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stats = OffloadStats()
        self._stream = None
        self._contexts: list = []      # the entered saved_tensors_hooks, one per block call in flight
        self._last = None              # weakref to the last block call's frame

    @property
    def stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    # -- the forward ---------------------------------------------------------------------------
    def enter(self, module, args, kwargs):
        frame = _Frame(self._last)
        self._last = weakref.ref(frame)
        context = torch.autograd.graph.saved_tensors_hooks(functools.partial(self.pack, frame), self.unpack)
        context.__enter__()
        self._contexts.append((context, frame))

    def leave(self, module, args, kwargs, output):
        context, frame = self._contexts.pop()
        frame.held.clear()          # the originals go: only the host copies stay
        context.__exit__(None, None, None)

    def _moved(self, t: torch.Tensor) -> bool:
        if _is_parameter(t):
            self.stats.kept_parameters += 1
            return False
        if (type(t) is not torch.Tensor or t.device.type != self.device.type or t.numel() == 0
                or t.numel() * t.element_size() < self.config.min_bytes or not is_non_overlapping_and_dense(t)):
            self.stats.kept_small += 1
            return False
        return True

    def pack(self, frame: _Frame, t: torch.Tensor):
        if not self._moved(t):
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        if key in frame.held:
            self.stats.reused += 1
            return frame, frame.held[key][1]
        record = _Record(*self._to_host(t))
        frame.held[key] = (t, record)
        frame.records.append(record)
        self.stats.packed += 1
        self.stats.packed_bytes += record.host.numel() * record.host.element_size()
        return frame, record

    def _to_host(self, t: torch.Tensor):
        host = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=self.cuda)
        if not self.cuda:
            return host.copy_(t), None
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            copied = stream.record_event()
        t.record_stream(stream)         # the compute stream may free it now: its block waits for the copy
        return host, copied

    # -- the backward --------------------------------------------------------------------------
    def unpack(self, packed):
        if isinstance(packed, torch.Tensor):
            return packed
        frame, record = packed
        if not frame.started:
            frame.started = True
            previous = frame.previous() if frame.previous is not None else None
            frame.previous = None
            if previous is not None and not previous.started:
                self._prefetch(previous)
        self.stats.unpacked += 1
        if record.prefetched is not None:
            t, event = record.prefetched
            record.prefetched = None
            self.stats.prefetched += 1
            if self.cuda:
                current = torch.cuda.current_stream(self.device)
                current.wait_event(event)
                t.record_stream(current)
        else:
            t = record.back() if record.back is not None else None
            if t is None:
                t = self._to_device(record)
        record.back = weakref.ref(t)
        return t

    def _to_device(self, record: _Record) -> torch.Tensor:
        if not self.cuda:
            return record.host              # one memory: the host copy itself, a storage apart from the original
        torch.cuda.current_stream(self.device).wait_event(record.copied)
        return record.host.to(self.device, non_blocking=True)

    def _prefetch(self, frame: _Frame) -> None:
        for record in frame.records:
            if not self.cuda:
                record.prefetched = (record.host, None)
                continue
            stream = self.stream
            with torch.cuda.stream(stream):
                stream.wait_event(record.copied)
                t = record.host.to(self.device, non_blocking=True)
                record.prefetched = (t, stream.record_event())


def install_offload(blocks, config: OffloadConfig, device) -> ActivationOffloader:
    """Offload the saved activations of each of `blocks` (modules called once per forward each) to host;
    returns the offloader, whose `stats` count what moved."""
    offloader = ActivationOffloader(config, device)
    for block in blocks:
        block.register_forward_pre_hook(offloader.enter, with_kwargs=True)
        block.register_forward_hook(offloader.leave, with_kwargs=True, always_call=True)
    return offloader
