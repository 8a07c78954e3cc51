"""Running one model chunk of a cut model (cut.py) through the model's own forward.

Owns: `run_chunk`. The model is called as usual with the micro-batch's inputs (so it builds its own
attention masks and position embeddings, which are cheap); each layer list iterates only the
chunk's layers. A chunk that starts inside a segment (see layout.py) runs that segment's embeddings
as stand-ins returning zeros of the right shape, and a pre-hook on its first layer swaps in the
tensors received from the previous stage (the hidden states, and what the layout says a boundary
carries, T5's position bias). The stacks of earlier segments (an encoder, for a decoder stage) are
stand-ins returning the outputs received for them. A chunk that ends inside a segment stops at its
last layer (a hook raising a private BaseException) and hands its hidden states on; one that ends a
segment stops after the segment's stack returns and hands on that segment's output, with the
outputs of every earlier segment (the decoder's cross-attention reads the encoder output on every
decoder stage). A chunk without layers (more stages than layers, layout.empty_stage_refusal) runs one
pass-through layer, which receives, stops and hands on as a layer would. Everything a chunk puts in place
is taken away when it ends, whatever happens.

The HF config is never written. A forward reads two things from it by the numbering of the layers
it iterates, and a chunk must read its own: per-layer lists (`config.layer_types[i]` for the i-th
layer of `enumerate(self.layers)`: a chunk starting at layer k reads entry k at its iteration 0) and
the count a stack loops over (`range(config.num_hidden_layers)`: BLIP-2's Q-Former; ALBERT's
iterations and groups). While a chunk runs, the modules holding such a config as `self.config`
(found once, when the model was cut) hold a view of it instead: a shallow copy made for this call
with the chunk's entries, so anything set on the config after boost (`use_cache`, the attention
implementation) still reaches the forward; the config goes back on the modules when the chunk ends.
Setting these once at cut time cannot work: a rank running several chunks (interleaved) numbers
each chunk's layers differently, and the config may be shared (with the user, with another model).

Must not communicate (p2p.py and the schedule do) nor cut a model (cut.py).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from meshboost.pipeline.layout import Segment
from meshboost.pipeline.stand_ins import AbsentEmbedding, ReceivedOutput, put_at


class _StageOutput(BaseException):
    """Stops the HF forward at the end of a chunk. `tensors`: the hidden states and carried layer
    outputs of a chunk ending inside a segment (empty when it ends a segment). A BaseException so
    that no `except Exception` in model code can swallow it."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.tensors = tensors


class _PassThrough(nn.Module):
    """The one layer a chunk without layers runs (layout.empty_stage_refusal): it returns the hidden states it
    is given, so the chunk's hooks receive and hand on exactly what a layer boundary would."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


@dataclass(frozen=True)
class _ChunkBounds:
    """Where a chunk sits among the segments: its global layers, the first and last segment they
    fall in, whether it runs the first one's embeddings and the last one's tail, and the modules it
    runs as its layers (a pass-through for a chunk without layers)."""

    layers: range
    first: int
    last: int
    starts: bool
    ends: bool
    running: tuple

    @property
    def segments(self) -> range:
        return range(self.first, self.last + 1)


def run_chunk(stages, chunk: int, inputs: dict, received: list[torch.Tensor] | None):
    """`stages.forward_chunk` (a `PipelineStages`, stage.py): run local `chunk` on one micro-batch's
    `inputs`; returns the model output on the last stage, else the tensors to send on."""
    bounds = _bounds(stages, chunk)
    received = list(received or [])
    earlier = received[:bounds.first]                               # outputs of the segments before it
    captured: dict[int, torch.Tensor] = {}
    swaps = {stages.spans[j].segment.stack: ReceivedOutput(earlier[j]) for j in range(bounds.first)}
    try:
        with contextlib.ExitStack() as scope:
            scope.callback(_clear_chunk_state, stages)
            if not bounds.starts:
                swaps.update(_embedding_stand_ins(stages, bounds, received[bounds.first]))
                _receive_at_first_layer(stages, bounds, received, scope)
            if not stages.is_last(chunk):
                _stop_at_chunk_end(stages, bounds, captured, scope)
            _iterate_only(stages, bounds)                     # before _config_entries, which counts them
            scope.enter_context(_swapped(stages.model.base_model, swaps))
            scope.enter_context(_config_views(stages.config_holders, _config_entries(stages, bounds)))
            return stages.model(**_withheld(stages, bounds, inputs))
    except _StageOutput as done:
        return earlier + [captured[j] for j in bounds.segments if j in captured] + done.tensors


def _withheld(stages, bounds: _ChunkBounds, inputs: dict) -> dict:
    """`inputs` without those only the stand-in embeddings would read (see `Segment.embedding_inputs`):
    of every segment before the chunk's first, and of that one when the chunk starts inside it."""
    segments = [stages.spans[j].segment for j in range(bounds.first + (0 if bounds.starts else 1))]
    drop = {name for segment in segments for name in segment.embedding_inputs}
    return {k: v for k, v in inputs.items() if k not in drop} if drop else inputs


def _bounds(stages, chunk: int) -> _ChunkBounds:
    virtual = stages.virtual(chunk)
    layers = stages.layer_ranges[virtual]
    if len(layers):
        first, last = stages.segment_of(layers.start), stages.segment_of(layers[-1])
        running = tuple(stages.kept[i] for i in layers)
    else:                                   # no layer here: one segment only (layout.empty_stage_refusal)
        first = last = 0
        running = (_PassThrough(),)
    return _ChunkBounds(layers, first, last, starts=stages.spans[first].first_stage == virtual,
                        ends=stages.spans[last].last_stage == virtual, running=running)


def _embedding_stand_ins(stages, bounds: _ChunkBounds, hidden: torch.Tensor) -> dict:
    """The stand-ins of the first segment's embeddings, for a chunk starting inside it. An `AbsentEmbedding`
    answers zeros shaped like the whole sequence (under sequence parallelism the received hidden
    states hold 1/seq_split of it between the segment's first layer and its last, which split and gather it)."""
    span = stages.spans[bounds.first]
    segment = span.segment
    split = stages.seq_split if span.offset < bounds.layers.start < span.stop else 1
    swaps = {}
    for path in segment.embeddings:
        stand_in = stages.stand_ins.get(path)
        if stand_in is None:
            continue
        if isinstance(stand_in, AbsentEmbedding):
            stand_in.hidden_like = hidden if split == 1 else hidden.new_zeros(
                (hidden.shape[0], hidden.shape[1] * split, *hidden.shape[2:]))
        swaps[path] = stand_in
    return swaps


def _receive_at_first_layer(stages, bounds: _ChunkBounds, received: list, scope: contextlib.ExitStack) -> None:
    """The chunk's first layer takes the received hidden states and carried outputs as its inputs."""
    segment = stages.spans[bounds.first].segment
    hook = _replace_inputs(received[bounds.first], segment.carry, received[bounds.first + 1:])
    # prepended: the layer's own hooks (sequence parallelism's) see the received hidden states
    handle = bounds.running[0].register_forward_pre_hook(hook, with_kwargs=True, prepend=True)
    scope.callback(handle.remove)


def _stop_at_chunk_end(stages, bounds: _ChunkBounds, captured: dict, scope: contextlib.ExitStack) -> None:
    """The forward ends where the chunk does: after the stack of the last segment it completes, or
    at its last layer when it ends inside a segment. Each segment it completes leaves its output in
    `captured`, to be handed on."""
    base, handles = stages.model.base_model, []
    for j in bounds.segments:
        if j < bounds.last or bounds.ends:                          # this chunk completes segment j
            stack = base.get_submodule(stages.spans[j].segment.stack)
            handles.append(stack.register_forward_hook(_segment_done(j, captured, stop=j == bounds.last)))
    if not bounds.ends:
        last_layer = bounds.running[-1]
        handles.append(last_layer.register_forward_hook(_stop_with_output(stages.spans[bounds.last].segment)))
    for handle in handles:
        scope.callback(handle.remove)


def _iterate_only(stages, bounds: _ChunkBounds) -> None:
    """Each layer list iterates only the chunk's layers (until `_clear_chunk_state`); a chunk without
    layers runs its pass-through in its one segment."""
    layers = bounds.layers
    for j, span in enumerate(stages.spans):
        if span.layer_list is not None:
            span.layer_list.running = [stages.kept[i] for i in layers if span.offset <= i < span.stop] \
                if len(layers) else (list(bounds.running) if j == bounds.first else [])


def _clear_chunk_state(stages) -> None:
    for span in stages.spans:
        if span.layer_list is not None:
            span.layer_list.running = None
    for stand_in in stages.stand_ins.values():
        if isinstance(stand_in, AbsentEmbedding):
            stand_in.hidden_like = None


def _config_entries(stages, bounds: _ChunkBounds) -> list[tuple[object, dict]]:
    """(config, {attribute: the chunk's value}) for each config the chunk's forward must read by
    the chunk's own layer numbering (see the module docstring)."""
    entries: dict[int, tuple[object, dict]] = {}

    def add(config, values: dict) -> None:
        if values:
            entries.setdefault(id(config), (config, {}))[1].update(values)

    first = stages.spans[bounds.first]
    local = range(bounds.layers.start - first.offset, min(bounds.layers.stop, first.stop) - first.offset)
    add(first.config, _per_layer_entries(first.config, local))
    for j in bounds.segments:
        span = stages.spans[j]
        if span.counted_config is not None:      # the stack loops over its config's count: the chunk's
            n = len(span.layer_list.running)
            values = {"num_hidden_layers": n}
            if span.segment.shared_groups:       # n iterations over n groups: iteration i reads running[i]
                values[span.segment.shared_groups] = n
            add(span.counted_config, values)
    return list(entries.values())


def _per_layer_entries(config, indices: range) -> dict:
    """The model's forward numbers the layers it iterates from 0 (`enumerate(self.layers)`) and reads
    per-layer settings by that number (`config.layer_types[i]`: sliding or full attention, and the
    like): for a chunk running the segment's layers `indices`, every per-layer list of the config,
    starting with the chunk's entries, so its first layer gets its own mask and rope, not layer 0's."""
    num_layers = getattr(config, "num_hidden_layers", None)
    if indices.start == 0 or not isinstance(num_layers, int):
        return {}
    return {key: type(value)([value[i] for i in indices] + [value[i] for i in range(num_layers) if i not in indices])
            for key, value in vars(config).items() if isinstance(value, (list, tuple)) and len(value) == num_layers}


@contextlib.contextmanager
def _config_views(holders: dict[int, list], entries: list[tuple[object, dict]]):
    """While the chunk runs, each module holding one of `entries`' configs as `self.config` holds a
    copy of it with the chunk's values instead; the config object itself is never written."""
    swapped = []
    try:
        for config, values in entries:
            view = copy.copy(config)
            for name, value in values.items():
                setattr(view, name, value)
            for module in holders.get(id(config), ()):
                module.__dict__["config"] = view
                swapped.append((module, config))
        yield
    finally:
        for module, config in swapped:
            module.__dict__["config"] = config


def _replace_inputs(hidden: torch.Tensor, carry, carried: list[torch.Tensor]):
    """Pre-hook on a chunk's first layer: the received hidden states, and each carried output at
    its argument (positional when the stack passes it positionally, else by keyword)."""
    def hook(module, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        if args:
            args[0] = hidden
        else:
            kwargs["hidden_states"] = hidden
        for c, value in zip(carry, carried):
            if len(args) > c.position:
                args[c.position] = value
            else:
                kwargs[c.name] = value
        return tuple(args), kwargs
    return hook


def _stop_with_output(segment: Segment):
    def hook(module, args, output):
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        raise _StageOutput([outputs[0], *[outputs[c.output] for c in segment.carry]])
    return hook


def _segment_done(index: int, captured: dict, stop: bool):
    def hook(module, args, output):
        captured[index] = output[0]
        if stop:
            raise _StageOutput([])
    return hook


@contextlib.contextmanager
def _swapped(root, replacements: dict):
    """Temporarily put `replacements` (path -> module or tensor) in place under `root`."""
    saved = {path: put_at(root, path, module) for path, module in replacements.items()}
    try:
        yield
    finally:
        for path, module in saved.items():
            put_at(root, path, module)
