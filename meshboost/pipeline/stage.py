"""Pipeline stages cut from an unmodified HuggingFace model.

Owns: removing from the model every module this rank's stages do not hold (in place, so the
model keeps its class, its parameter names and its own forward), finding weights that several
pipeline ranks hold (an embedding tied to the LM head), and running one model chunk through the
model's own forward.

How a stage runs its slice without forking the HF forward: the model is called as usual with
the micro-batch's inputs (so it builds its own attention masks and position embeddings, which
are cheap); each layer list iterates only the chunk's layers. A chunk that starts inside a
segment (see layout.py) runs that segment's embeddings as stand-ins returning zeros of the right
shape, and a pre-hook on its first layer swaps in the tensors received from the previous stage
(the hidden states, and what the layout says a boundary carries, T5's position bias). The stacks
of earlier segments (an encoder, for a decoder stage) are stand-ins returning the outputs
received for them. A chunk that ends inside a segment stops at its last layer (a hook raising a
private BaseException) and hands its hidden states on; one that ends a segment stops after the
segment's stack returns and hands on that segment's output, with the outputs of every earlier
segment (the decoder's cross-attention reads the encoder output on every decoder stage).
Must not communicate: p2p.py and schedule.py do that.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.distributed.param_info import PipelineTie, set_pipeline_tie
from meshboost.pipeline.layout import Segment, StageLayout, get_layout, split_layers
from meshboost.pipeline.stand_ins import AbsentEmbedding, AbsentLayer, AbsentModule, ReceivedOutput, stand_in_for


class _StageOutput(BaseException):
    """Stops the HF forward at the end of a chunk. `tensors`: the hidden states and carried layer
    outputs of a chunk ending inside a segment (empty when it ends a segment). A BaseException so
    that no `except Exception` in model code can swallow it."""

    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.tensors = tensors


class StageLayerList(nn.ModuleList):
    """The layers this rank holds, registered under their original indices (so parameter names stay
    the model's own). While a chunk runs, iteration, len and indexing see only its layers, in order
    (the model's forward loops over them). Outside a step, iteration and len see the layers held here,
    and `layers[i]` is the model's layer i by its original index: the layer itself, or for one another
    stage holds its `AbsentLayer` (every tensor None), never another layer that happens to sit at
    position i here."""

    def __init__(self, layers: dict[int, nn.Module], absent: dict[int, nn.Module] | None = None):
        super().__init__()
        for index, layer in layers.items():
            self.add_module(str(index), layer)
        self.running: list[nn.Module] | None = None
        self.__dict__["_absent"] = dict(absent or {})       # not submodules: they hold nothing of the model

    def _visible(self) -> list[nn.Module]:
        return self.running if self.running is not None else list(self._modules.values())

    def __iter__(self):
        return iter(self._visible())

    def __len__(self) -> int:
        return len(self._visible())

    def __getitem__(self, idx):
        if self.running is not None:
            return self.running[idx]
        size = len(self._modules) + len(self.__dict__["_absent"])
        if isinstance(idx, slice):
            return nn.ModuleList([self[i] for i in range(size)[idx]])
        index = idx + size if isinstance(idx, int) and idx < 0 else idx
        if str(index) in self._modules:
            return self._modules[str(index)]
        if index in self.__dict__["_absent"]:
            return self.__dict__["_absent"][index]
        raise IndexError(f"layer index {idx} is out of range: the model has {size} layers (this pipeline rank "
                         f"holds {sorted(int(k) for k in self._modules)})")


@dataclass
class PipelineStages:
    """The model chunks one rank runs. Chunk c of pipeline rank r is virtual stage c * pp_size + r.
    Layers are numbered globally over the layout's segments in order (an encoder's, then a decoder's)."""

    model: nn.Module
    layout: StageLayout
    pp_rank: int
    pp_size: int
    num_chunks: int
    layer_ranges: list[range]                 # per virtual stage, global layer indices
    offsets: list[int]                        # global index of each segment's first layer
    sizes: list[int]                          # layers per segment
    kept: dict[int, nn.Module]                # global index -> layer this rank holds
    layer_lists: dict[int, StageLayerList]    # segment -> its layer list on this rank
    stand_ins: dict[str, nn.Module | torch.Tensor]   # embeddings path -> stand-in
    # weights held by several pipeline ranks: (those pp ranks, the ones held here), the same sets
    # on every rank (groups are built collectively)
    ties: list[tuple[tuple[int, ...], list[nn.Parameter]]] = field(default_factory=list)
    # sequence parallelism over tp ranks: received hidden states hold 1/seq_split of the sequence
    seq_split: int = 1

    @property
    def num_virtual(self) -> int:
        return self.pp_size * self.num_chunks

    def virtual(self, chunk: int) -> int:
        return chunk * self.pp_size + self.pp_rank

    def is_first(self, chunk: int) -> bool:
        return self.virtual(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.virtual(chunk) == self.num_virtual - 1

    def segment_of(self, index: int) -> int:
        return max(j for j, off in enumerate(self.offsets) if off <= index)

    def forward_chunk(self, chunk: int, inputs: dict, received: list[torch.Tensor] | None):
        """Run local `chunk` through the model's own forward. `received`: what the previous stage sent
        (None on the first stage): the outputs of the segments before this chunk's first one, then,
        when the chunk starts inside a segment, its hidden states and carried layer outputs. Returns
        the model output on the last stage, else the list to send on (same convention)."""
        segments, base = self.layout.segments, self.model.base_model
        span = self.layer_ranges[self.virtual(chunk)]
        k0, k1 = self.segment_of(span.start), self.segment_of(span[-1])
        starts = span.start == self.offsets[k0]
        ends = span[-1] == self.offsets[k1] + self.sizes[k1] - 1
        received = list(received or [])
        earlier = received[:k0]                                    # outputs of segments before k0
        swaps: dict[str, nn.Module] = {segments[j].stack: ReceivedOutput(earlier[j]) for j in range(k0)}
        handles, captured = [], {}
        if not starts:
            hidden, carried = received[k0], received[k0 + 1:]
            for path in segments[k0].embeddings:
                if path in self.stand_ins:
                    swaps[path] = self.stand_ins[path]
                    if isinstance(swaps[path], AbsentEmbedding):    # shaped like the whole sequence
                        swaps[path].hidden_like = hidden if self.seq_split == 1 else hidden.new_zeros(
                            (hidden.shape[0], hidden.shape[1] * self.seq_split, *hidden.shape[2:]))
            # prepended: the layer's own hooks (sequence parallelism's) see the received hidden states
            handles.append(self.kept[span.start].register_forward_pre_hook(
                _replace_inputs(hidden, segments[k0].carry, carried), with_kwargs=True, prepend=True))
        if not self.is_last(chunk):
            for j in range(k0, k1 + 1):
                if j < k1 or ends:                                 # this chunk completes segment j
                    stack = base.get_submodule(segments[j].stack)
                    handles.append(stack.register_forward_hook(_segment_done(j, captured, stop=j == k1)))
            if not ends:
                handles.append(self.kept[span[-1]].register_forward_hook(_stop_with_output(segments[k1])))
        for j, layer_list in self.layer_lists.items():
            first, stop = self.offsets[j], self.offsets[j] + self.sizes[j]
            layer_list.running = [self.kept[i] for i in span if first <= i < stop]
        off = self.offsets[k0]
        local = range(span.start - off, min(span.stop, off + self.sizes[k0]) - off)    # k0's own layer numbers
        config = getattr(base.get_submodule(segments[k0].stack), "config", self.model.config)
        try:
            with contextlib.ExitStack() as scope:
                scope.enter_context(_swapped(base, swaps))
                scope.enter_context(_per_layer_config(config, local))
                for j in range(k0, k1 + 1):
                    if segments[j].counted_by:       # the stack loops over its config's count: the chunk's
                        counted = base.get_submodule(segments[j].counted_by).config
                        n = len(self.layer_lists[j].running)
                        scope.enter_context(_set_attr(counted, "num_hidden_layers", n))
                        if segments[j].shared_groups:    # n iterations over n groups: iteration i reads running[i]
                            scope.enter_context(_set_attr(counted, segments[j].shared_groups, n))
                return self.model(**inputs)
        except _StageOutput as done:
            return earlier + [captured[j] for j in range(k0, k1 + 1) if j in captured] + done.tensors
        finally:
            for layer_list in self.layer_lists.values():
                layer_list.running = None
            for stand_in in self.stand_ins.values():
                if isinstance(stand_in, AbsentEmbedding):
                    stand_in.hidden_like = None
            for h in handles:
                h.remove()


@contextlib.contextmanager
def _per_layer_config(config, indices: range):
    """The model's forward numbers the layers it iterates from 0 (`enumerate(self.layers)`) and reads
    per-layer settings by that number (`config.layer_types[i]`: sliding or full attention, and the
    like): while a chunk runs, every per-layer list of the config starts with this chunk's entries,
    so the chunk's first layer gets its own mask and rope, not layer 0's."""
    num_layers = getattr(config, "num_hidden_layers", None)
    lists = {k: v for k, v in vars(config).items()
             if isinstance(v, (list, tuple)) and isinstance(num_layers, int) and len(v) == num_layers}
    if not lists or indices.start == 0:
        yield
        return
    try:
        for key, value in lists.items():
            reordered = [value[i] for i in indices] + [value[i] for i in range(num_layers) if i not in indices]
            setattr(config, key, type(value)(reordered))
        yield
    finally:
        for key, value in lists.items():
            setattr(config, key, value)


@contextlib.contextmanager
def _set_attr(obj, name: str, value):
    saved = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, saved)


def _only_through_schedule(layer_list: StageLayerList):
    def hook(module, args):
        if layer_list.running is None:
            raise RuntimeError("this model is one pipeline stage; with pp_size > 1 run it through "
                               "booster.execute_pipeline(data_iter, model, criterion, optimizer)")
    return hook


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
def _swapped(root: nn.Module, replacements: dict[str, nn.Module]):
    """Temporarily put `replacements` (path -> module) in place under `root`."""
    saved = {path: _set(root, path, module) for path, module in replacements.items()}
    try:
        yield
    finally:
        for path, module in saved.items():
            _set(root, path, module)


def _set(root: nn.Module, path: str, value):
    """Put `value` (a module, or a parameter's stand-in tensor and back) at `path`; returns what was there."""
    parent_path, _, leaf = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, leaf)
    if not (isinstance(value, nn.Module) and leaf in parent._modules):
        parent._parameters.pop(leaf, None)         # a parameter becomes a plain tensor attribute, and back
        parent.__dict__.pop(leaf, None)
    setattr(parent, leaf, value)
    return old


def _under(name: str, path: str) -> bool:
    return name == path or name.startswith(path + ".")


def build_stages(model: nn.Module, pp_rank: int, pp_size: int, num_chunks: int = 1,
                 num_layers_per_stage: list[int] | None = None, layout: dict | None = None) -> PipelineStages:
    """Cut `model` in place down to the chunks of pipeline rank `pp_rank`. `layout`: the family's
    declared pipeline layout (see `get_layout`). Every check runs before the model is touched, and
    none communicates, so every rank raises the same error."""
    layout = get_layout(model, layout)
    if getattr(getattr(model, "config", None), "use_weighted_layer_sum", False):
        raise ValueError(f"{type(model).__name__} has config.use_weighted_layer_sum=True: its head mixes the hidden "
                         "states of every layer, which no pipeline stage holds; use pp_size=1, or "
                         "use_weighted_layer_sum=False")
    segments = layout.segments
    base = getattr(model, "base_model", model)
    lists = [base.get_submodule(s.layers) for s in segments]
    if any(isinstance(layer_list, StageLayerList) for layer_list in lists):
        raise ValueError(f"{type(model).__name__} was already cut into pipeline stages by an earlier boost: boost the "
                         "original model once; to start over, build a fresh model (or load its checkpoint into one)")
    base_prefix = next((n for n, m in model.named_modules() if m is base), "")
    # group of each iteration, for a segment whose stack loops over shared layer groups (ALBERT)
    groups = [_iteration_groups(base, s, layer_list) for s, layer_list in zip(segments, lists)]
    sizes = [len(g) if g is not None else len(layer_list) for g, layer_list in zip(groups, lists)]
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    num_virtual = pp_size * num_chunks
    layer_ranges = split_layers(sum(sizes), num_virtual, num_layers_per_stage)
    stage_of = {i: v for v, r in enumerate(layer_ranges) for i in r}
    first_stage = [stage_of[off] for off in offsets]                      # holds segment j's embeddings
    last_stage = [stage_of[off + n - 1] for off, n in zip(offsets, sizes)]   # holds segment j's tail

    def owner(name: str) -> set[int] | None:
        """Virtual stages holding the parameter `name` (a full model name), or None if the layout misses it."""
        if base_prefix and not name.startswith(base_prefix + "."):
            return {num_virtual - 1}                                      # a head: outside the base model
        rel = name[len(base_prefix) + 1:] if base_prefix else name
        for j, s in enumerate(segments):
            if any(_under(rel, p) for p in s.embeddings):
                return {first_stage[j]}
            if rel.startswith(s.layers + "."):
                index = int(rel[len(s.layers) + 1:].split(".", 1)[0])
                if groups[j] is None:
                    return {stage_of[offsets[j] + index]}
                return {stage_of[offsets[j] + it] for it, g in enumerate(groups[j]) if g == index}
            if any(_under(rel, p) for p in s.tail):
                return {last_stage[j]}
        return None

    owners: dict[int, set[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        o = owner(name)
        if not o:
            why = (f" (this {type(model).__name__} lacks the layout's {list(layout.missing)}: a variant the layout "
                   "does not describe)" if layout.missing else "")
            raise ValueError(f"pipeline layout {layout.name!r} does not place parameter {name!r}{why}; add its module "
                             "to the layout's embeddings or tail (the family's Policy(pipeline_layout=...)) or use "
                             "pp_size=1")
        owners.setdefault(id(p), set()).update(o)
        params[id(p)] = p
    tie_sets: dict[tuple[int, ...], list[nn.Parameter]] = {}
    for i, o in owners.items():
        ranks = tuple(sorted({v % pp_size for v in o}))
        if len(ranks) > 1:
            tie_sets.setdefault(ranks, []).append(params[i])

    mine = [v for v in range(num_virtual) if v % pp_size == pp_rank]
    held = {i for v in mine for i in layer_ranges[v]}
    kept = {i: lists[j][i - offsets[j]] if groups[j] is None else _Iteration(lists[j][groups[j][i - offsets[j]]])
            for j in range(len(segments)) for i in range(offsets[j], offsets[j] + sizes[j]) if i in held}
    stand_ins = {p: stand_in_for(_resolve(base, p)) for s in segments for p in s.embeddings
                 if _resolve(base, p) is not None}

    def holders(j: int, index: int) -> list[int]:
        """The pipeline ranks holding entry `index` of segment j's layer list (a layer, or a shared group)."""
        if groups[j] is None:
            return [stage_of[offsets[j] + index] % pp_size]
        return sorted({stage_of[offsets[j] + it] % pp_size for it, g in enumerate(groups[j]) if g == index})

    layer_lists: dict[int, StageLayerList] = {}
    absent_stacks = []
    for j, s in enumerate(segments):
        if first_stage[j] % pp_size != pp_rank:
            for path in s.embeddings:
                if path in stand_ins:
                    _set(base, path, stand_ins[path])
        if last_stage[j] % pp_size != pp_rank:
            for path in s.tail:
                if _resolve(base, path) is not None:
                    _set(base, path, AbsentModule(path, "last" if j == len(segments) - 1 else "other"))
        mine_j = {i - offsets[j]: kept[i] for i in range(offsets[j], offsets[j] + sizes[j]) if i in kept}
        if groups[j] is not None:           # hold the groups themselves, under their own indices
            mine_j = {g: lists[j][g] for g in sorted({groups[j][i] for i in mine_j})}
        if mine_j or not s.stack:
            absent = {i: AbsentLayer(lists[j][i], f"{s.layers}.{i}", holders(j, i))
                      for i in range(len(lists[j])) if i not in mine_j}
            layer_lists[j] = StageLayerList(mine_j, absent)
            _set(base, s.layers, layer_lists[j])
        else:
            absent_stacks.append(s.stack)
    for path in absent_stacks:                 # a segment with no layer here: nothing in its stack is held
        _set(base, path, AbsentModule(path, "other"))
    if pp_rank != pp_size - 1:
        heads = [] if model is base else list(model.named_children())
        for name, child in heads:
            if child is not base and any(True for _ in child.parameters()):
                setattr(model, name, AbsentModule(name, "last"))

    ties = []
    for ranks, tied in sorted(tie_sets.items()):
        here = pp_rank in ranks
        if here:
            for p in tied:
                # The lowest holder's copy is the weight; the others are replicas (not counted twice in norms).
                set_pipeline_tie(p, PipelineTie(replica=pp_rank != ranks[0]))
        ties.append((ranks, tied if here else []))
    model.register_forward_pre_hook(_only_through_schedule(next(iter(layer_lists.values()))))
    return PipelineStages(model, layout, pp_rank, pp_size, num_chunks, layer_ranges, offsets, sizes, kept,
                          layer_lists, stand_ins, ties)


class _Iteration(nn.Module):
    """One iteration of a shared layer group (ALBERT runs its group num_hidden_layers times): a
    distinct object per iteration, so a stage's hooks fire at its own first and last iteration."""

    def __init__(self, group: nn.Module):
        super().__init__()
        self.__dict__["group"] = group                 # not a submodule: the model tree holds the group

    def forward(self, *args, **kwargs):
        return self.group(*args, **kwargs)


def _iteration_groups(base: nn.Module, segment: Segment, layer_list: nn.ModuleList) -> list[int] | None:
    """The group each iteration uses (HF's own formula), for a segment with shared groups."""
    if not segment.shared_groups:
        return None
    config = base.get_submodule(segment.counted_by).config
    iterations, count = config.num_hidden_layers, getattr(config, segment.shared_groups)
    if count != len(layer_list):
        raise ValueError(f"{segment.layers} holds {len(layer_list)} groups but config.{segment.shared_groups}="
                         f"{count}; the layout's shared_groups must name the attribute counting them")
    return [int(i / (iterations / count)) for i in range(iterations)]


def _resolve(root: nn.Module, path: str) -> nn.Module | nn.Parameter | None:
    """The module or parameter at `path`, or None when the model has none there."""
    parent_path, _, leaf = path.rpartition(".")
    try:
        parent = root.get_submodule(parent_path) if parent_path else root
    except AttributeError:
        return None
    value = getattr(parent, leaf, None)
    return value if isinstance(value, (nn.Module, nn.Parameter)) else None


def prune_optimizer(optimizer, model: nn.Module) -> None:
    """Drop from `optimizer` (a torch optimizer built on the whole model) the parameters this
    stage no longer holds, so they are neither stepped nor kept alive."""
    if optimizer is None:
        return
    keep = {id(p) for p in model.parameters()}
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) in keep]
    for p in list(optimizer.state):
        if id(p) not in keep:
            del optimizer.state[p]
