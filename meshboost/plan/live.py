"""One fake training step of a model, counted as torch's MemTracker counts it: the bytes alive after its
forward and after each op of forward and backward, and the gradient bytes accumulated by each op.

Owns `live_peak` (the run and its timeline), `LiveBytes` (the counter) and `last_layer` (where a
pipeline stage that is not the last ends its forward). Must not decide what the figures mean for a
layout (activations.py, peak.py) nor build the model or its inputs (activations.py does, on fake tensors).

Why not MemTracker itself. The planner reads one number of it per op: the bytes of the storages that
ops created and that are still alive (its ACT and TEMP categories; the parameters and buffers, which
it files under their own, left out), each storage once whatever views of it exist, the meta device's
left out (plan/tracker.py says why). MemTracker computes that number along with per-category,
per-device and per-module snapshots (a deep copy at every new peak) that the planner never reads, and
that bookkeeping was half of each fake run's time. `LiveBytes` keeps the one number, by MemTracker's
own rules: every tensor an op returns is looked at, a storage seen for the first time is counted
(its bytes as MemTracker's `_WeakRefInfo` counts them, rounded up to 512 bytes on CUDA) until the
storage is freed, a storage seen again is counted once (its new size if it grew). Its timelines equal
MemTracker's op for op (tests/plan/test_fakecache.py compares them on Llama, GPT-2, BERT and a MoE,
with checkpointing, sequence splits and pipeline stages); benchmarks/plan_peak.py's meter of a real
step still uses MemTracker (plan/tracker.py).
"""

from __future__ import annotations

import math
import weakref
from array import array

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from meshboost.plan.tracker import NO_MEMORY

CUDA_BLOCK = 512            # MemTracker's _PYTORCH_MIN_ALLOCATE: a CUDA allocation's granularity


class LiveBytes(TorchDispatchMode):
    """A dispatch mode noting, after each op, the bytes of the storages ops created that are alive
    (`totals`) and the gradient bytes accumulated by then (`grads`: `grad_bytes`, kept by the caller)."""

    def __init__(self, excluded):
        super().__init__()
        self.live = 0
        self.grad_bytes = 0
        self.totals = array("q")
        self.grads = array("q")
        self._grad_sizes: dict[int, int] = {}
        self.on_free = None                 # told (id(storage), bytes, first op) of each counted storage freed
        self.on_next_op = None              # called once, as the next op is dispatched
        self.on_sight = None                # told the bytes of a storage made outside the count, first seen now
        self._known: dict[int, list] = {}     # id(storage) -> [its weak reference, bytes, counted, first op]
        for t in excluded:          # parameters and buffers: tracked, never counted (MemTracker's PARAM/BUFFER)
            self._see(t, counted=False)

    def _see(self, t: torch.Tensor, counted: bool = True, made: bool = True) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        entry = self._known.get(key)
        if entry is None:           # first op: -1 for a view of a storage made before (outside) the count
            counted = counted and t.device.type not in NO_MEMORY
            entry = self._known[key] = [weakref.ref(storage, lambda ref, key=key: self._freed(key, ref)), 0, counted,
                                        len(self.totals) if made else -1]
            if not made and counted and self.on_sight is not None:
                self.on_sight(_bytes(storage, t.device))
        size = _bytes(storage, t.device)
        if size != entry[1]:                # new, or resized since it was seen (MemTracker's SIZE update)
            if entry[2]:
                self.live += size - entry[1]
            entry[1] = size

    def _freed(self, key: int, ref: weakref.ref) -> None:
        entry = self._known.get(key)
        if entry is not None and entry[0] is ref:
            del self._known[key]
            if entry[2]:
                self.live -= entry[1]
                if self.on_free is not None:
                    self.on_free(key, entry[1], entry[3])

    def counted_bytes(self, t: torch.Tensor) -> int:
        """The bytes `t`'s storage counts for (0: not counted, or never returned by an op)."""
        entry = self._known.get(id(t.untyped_storage()))
        return entry[1] if entry is not None and entry[2] else 0

    def made_since(self, op: int) -> int:
        """The counted bytes of the storages alive that op `op` or a later one first returned."""
        return sum(entry[1] for entry in self._known.values() if entry[2] and entry[3] >= op)

    def first_op(self, t: torch.Tensor) -> int:
        """The index of the op that first returned `t`'s storage (-1: none did, it came from outside)."""
        entry = self._known.get(id(t.untyped_storage()))
        return -1 if entry is None else entry[3]

    def grad_accumulated(self, p: torch.Tensor) -> None:
        """A parameter's gradient was accumulated: note its bytes (each parameter once) and drop it
        (gradients are counted as `gradients`, held or reduced as the layout does)."""
        size = p.grad.numel() * p.grad.element_size()
        self.grad_bytes += size - self._grad_sizes.get(id(p), 0)
        self._grad_sizes[id(p)] = size
        p.grad = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on_next_op is not None:         # told once, before the op after a mark (LayerMarks)
            self.on_next_op, call = None, self.on_next_op
            call()
        out = func(*args, **(kwargs or {}))
        made = not getattr(func, "is_view", False)
        if isinstance(out, torch.Tensor):
            self._see(out, made=made)
        else:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._see(t, made=made)
        self.totals.append(self.live)
        self.grads.append(self.grad_bytes)
        return out


def _bytes(storage, device: torch.device) -> int:
    n = storage.nbytes()
    return math.ceil(n / CUDA_BLOCK) * CUDA_BLOCK if device.type == "cuda" else n


def live_peak(model, inputs: dict, weights: set, stop_after=None, layer=None) -> tuple:
    """(distinct bytes autograd saves in the forward, `weights`' storages (the parameters: a linear
    saves its weight) left out; bytes alive once the forward has returned its loss; the bytes alive after
    each op of that forward and the backward: its maximum is the peak; the gradient bytes accumulated by
    each op; `layer`'s `LayerMarks` figures or None) of one training step of `model` on fake tensors,
    counted as torch's `MemTracker` counts them (`LiveBytes`: each storage once, whatever views autograd
    saved of it), the parameters and their gradients left out. The outputs but the loss are dropped, as
    a training step drops them (the logits are not saved: the loss's softmax is); each gradient is
    dropped once accumulated (they are counted as `gradients`, held or reduced as the layout does: the
    fourth figure says how many a step holds by each op when it keeps them), so the peak is what
    activations and the kernels' temporaries add. `stop_after`: `model` is a pipeline stage that is not
    the last, whose forward stops after this layer (no final norm, no pooler: pipeline/run.py) and sends
    its output on: the output is kept until the next stage's gradient of it arrives (the schedule's
    `saved`), and that gradient seeds the backward. `layer`: the stack's only layer, whose forward and
    backward are marked (`LayerMarks`: what a second layer would add, `two_layers`)."""
    tracker = LiveBytes([*model.parameters(), *model.buffers()])
    marks = LayerMarks(tracker, layer) if layer is not None else None
    saved: dict = {}

    def pack(t):
        storage = t.untyped_storage()._cdata
        if storage not in weights:
            key = (storage, t.storage_offset(), tuple(t.shape), t.dtype)
            new = key not in saved
            saved[key] = t.numel() * t.element_size()
            if marks is not None:
                marks.saved(t, saved[key] if new else 0)
        return t

    drops = [p.register_post_accumulate_grad_hook(tracker.grad_accumulated)
             for p in model.parameters() if p.requires_grad]
    try:
        with tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                root = _stage_output(model, inputs, stop_after)
            after = tracker.live
            if marks is not None:
                marks.after = len(tracker.totals)
            root.backward(torch.empty_like(root) if stop_after is not None else None)
    finally:
        for handle in drops:
            handle.remove()
        if marks is not None:
            marks.remove()
    # the timelines as 8-byte integers: the planner caches them per fake run (hundreds, ~2000 ops each)
    return sum(saved.values()), after, tracker.totals, tracker.grads, marks.figures() if marks else None


class LayerMarks:
    """Where the only layer of a fake run's stack runs in its timeline, and what of it a second copy of
    the layer would hold again: its forward [f0, f1) (the ops between its pre-forward and forward hooks,
    first call only: checkpointing calls it again in backward) and its backward [b0, b1) (from its
    output's gradient to its input's); the bytes it saves that a second layer would save again (views
    of storages its forward made, or of its input: not the position embeddings or masks made before it,
    which every layer saves once between them); the storages its forward made (its output left out)
    alive at its end and when each goes before its backward (a cache's keys and values go as the model
    returns); whether autograd saved its input and whether the input was gone by the next op (the
    model's forward may hold its embedding output to the end: a second layer's input, the first's
    output, has no such holder); the earlier tensors every layer saves that go in its backward (with two
    layers, in the first's, after the second's); its gradients' bytes. `two_layers` reads them."""

    def __init__(self, tracker: LiveBytes, layer):
        self.tracker = tracker
        self.f0 = self.f1 = self.b0 = self.b1 = self.after = None
        self.layer_saved = self.made = self.grads = 0
        self.input = self.output = self.input_ref = None            # id(storage) of each, a weak reference
        self.input_bytes = self.output_bytes = 0
        self.input_saved, self.input_gone, self.armed = False, None, False
        self.output_grad = self.output_grad_gone = None     # id(storage) of its output's gradient, op it went
        self.frees: list[tuple[int, int]] = []          # (op index, bytes) of what it made, gone before backward
        self.sighted: list[tuple[int, int]] = []        # (op index, bytes) of earlier storages first seen in it
        self.shared_frees: list[tuple[int, int]] = []   # (op index, bytes) of earlier tensors gone in its backward
        self.handles = [layer.register_forward_pre_hook(self._pre, with_kwargs=True),
                        layer.register_forward_hook(self._post, prepend=True),   # before a gather's hook
                        layer.register_forward_hook(self._returned)]                # after every hook
        tracker.on_free, tracker.on_sight = self._freed, self._sighted

    def _sighted(self, size: int) -> None:
        # a view of a tensor made before the count (the inputs' positions) is counted from the first op
        # that returns one; with two layers the first's forward has seen it before the second's runs
        if self.f0 is not None and self.f1 is None:
            self.sighted.append((self._now(), size))

    def _now(self) -> int:
        return len(self.tracker.totals)

    def _freed(self, key: int, size: int, first_op: int) -> None:
        if self.f1 is None:
            return
        if self.b0 is None and self.f0 <= first_op < self.f1 and key != self.output:
            self.frees.append((self._now(), size))
        elif self.b0 is not None and self.b1 is None and 0 <= first_op < self.f0 and key != self.input:
            self.shared_frees.append((self._now(), size))
        if key == self.output_grad and self.output_grad_gone is None:
            self.output_grad_gone = self._now()

    def _pre(self, module, args, kwargs):
        if self.f0 is None:
            self.f0 = self._now()
            hidden = args[0] if args else kwargs["hidden_states"]
            storage = hidden.untyped_storage()
            self.input, self.input_ref = id(storage), weakref.ref(storage)
            self.input_bytes = self.tracker.counted_bytes(hidden)
            if hidden.grad_fn is not None:      # its gradient is complete as the node that made it runs
                self.handles.append(hidden.grad_fn.register_prehook(self._input_grad))

    def _post(self, module, args, output):
        if self.f1 is None and self.f0 is not None:
            self.f1 = self._now()
            out = output[0] if isinstance(output, (tuple, list)) else output
            self.output, self.output_bytes = id(out.untyped_storage()), self.tracker.counted_bytes(out)
            self.made = self.tracker.made_since(self.f0) - self.output_bytes
            self.armed = True
            if out.grad_fn is not None:
                self.handles.append(out.grad_fn.register_prehook(self._output_grad))

    def _returned(self, module, args, output):
        if self.armed:          # the layer's call has returned: whether its input is gone shows at the next op
            self.armed = False
            self.tracker.on_next_op = self._next_op

    def _next_op(self) -> None:
        self.input_gone = self.input_ref() is None

    def _output_grad(self, grad_outputs) -> None:
        if self.b0 is None:
            self.b0 = self._now()
            if grad_outputs and grad_outputs[0] is not None:
                self.output_grad = id(grad_outputs[0].untyped_storage())
            self.grads = -self.tracker.grad_bytes

    def _input_grad(self, grad_outputs) -> None:
        if self.b1 is None:
            self.b1 = self._now()
            self.grads += self.tracker.grad_bytes

    def saved(self, t: torch.Tensor, size: int) -> None:
        """Autograd saved `t` (`size`: its bytes, 0 if that view was saved before)."""
        if self.f0 is not None and self.f1 is None:
            is_input = id(t.untyped_storage()) == self.input
            self.input_saved |= is_input
            if is_input or self.tracker.first_op(t) >= self.f0:
                self.layer_saved += size

    def figures(self) -> tuple | None:
        """What `two_layers` reads, None where a mark is missing."""
        marks = (self.f0, self.f1, self.b0, self.b1, self.after)
        if None in marks or self.input_gone is None or not self.f0 <= self.f1 <= self.after <= self.b0 <= self.b1:
            return None
        gone = self.output_grad_gone
        life = gone - self.b0 if gone is not None and gone <= self.b1 else None
        return (self.layer_saved, self.made, tuple(self.frees), tuple(self.sighted), self.input_bytes,
                self.input_saved, self.input_gone, self.output_bytes, self.grads, tuple(self.shared_frees), *marks,
                life)

    def remove(self) -> None:
        self.tracker.on_free = self.tracker.on_next_op = self.tracker.on_sight = None
        for handle in self.handles:
            handle.remove()


def two_layers(saved: int, after: int, totals: array, grads: array, layer: tuple, whole: tuple | None = None,
               gathered: bool = False) -> tuple:
    """`live_peak`'s figures for two copies of the layer, from those of a run with one (`layer`: its
    `LayerMarks` figures). The two-layer timeline is this one's with the layer's forward run twice, its
    backward twice, each op's bytes those of this run at the same op plus what the other layer holds
    then: in the second layer's forward, what the first made and still holds (its output: the second's
    input) and the views of earlier storages the first counted first; in the head and the loss, what
    the first made that is still alive at that op here, and its output where the second layer saves its
    input; in the second layer's backward (the first of the
    two), what the first made alive when the backward began, its input where saved, and the earlier
    tensors (masks, position embeddings) this run's layer lets go; the first layer's backward and the
    embedding's as here, the second layer's gradients (G) accumulated beside them. Exact where the
    layers are alike (the same ops on tensors of the same shapes; tests/plan/test_fakecache.py compares
    it with two-layer runs) but for a cache the first layer fills for the others (counted twice).
    `whole`: `layer` is a pipeline stage's body and these are the marks of the whole model's run of the
    same layer: the body's forward stops after its layer, letting go of what the model's forward held
    (its embedding output, a cache), so what the first layer leaves to the second's forward is read
    from the whole run; and its backward starts from a gradient held to the end (the schedule holds
    what it received), so the second layer's backward makes the first's output gradient beside it,
    alive as long as a layer's output gradient lives in the whole run. `gathered` (split_gather): the
    stage's output is gathered after its last layer, so the gradient it receives reaches the layer
    through the gather's backward, as a gradient of the layer's own output that lives as the one-layer
    run shows (nothing held to the end is added)."""
    (layer_saved, made, frees, sighted, in_bytes, in_saved, in_gone, out_bytes, g, shared_frees,
     f0, f1, b0, b1, after_op, _) = layer

    first_layer = [(at, -size) for at, size in frees]     # what the first layer made goes at these ops

    def plus(lo: int, hi: int, base: int, from_op=(), before_op=()) -> list[int]:
        """totals[lo:hi] plus `base`, each (op, size) of `from_op` added from that op on, of `before_op`
        before it."""
        extra = [base] * (hi - lo)
        for at, size in from_op:
            start = max(at, lo) - lo
            extra[start:] = [x + size for x in extra[start:]]
        for at, size in before_op:
            stop = max(0, min(at, hi) - lo)
            extra[:stop] = [x + size for x in extra[:stop]]
        return [x + e for x, e in zip(totals[lo:hi], extra)]

    def alive(op: int) -> int:              # what the first layer made (its output left out) alive at `op`
        return made - sum(size for at, size in frees if at <= op)

    def left(figures: tuple) -> int:        # what a layer leaves to the next one's forward
        made, frees, in_bytes, in_gone, out_bytes, f1 = (figures[i] for i in (1, 2, 4, 6, 7, 11))
        return made - sum(size for at, size in frees if at <= f1) + out_bytes - (in_bytes if in_gone else 0)

    forward = left(whole or layer)
    saved_input = out_bytes if in_saved else 0
    second = plus(f0, f1, forward, before_op=sighted)
    head = plus(f1, b0, made + saved_input, from_op=first_layer)
    backward = plus(b0, b1, alive(b0) + (in_bytes if in_saved else 0), from_op=shared_frees)
    received_life = whole[-1] if whole is not None and not gathered else None
    first_backward = plus(b0, len(totals), 0, before_op=[(b0 + received_life, out_bytes)] if received_life else ())
    two_totals = array("q", [*totals[:f1], *second, *head, *backward, *first_backward])
    two_grads = array("q", [*grads[:f1], *grads[f0:b1], *(x + g for x in grads[b0:])])
    return saved + layer_saved, after + alive(after_op) + saved_input, two_totals, two_grads


class _StageEnd(BaseException):
    """Ends a fake forward after a stage's last layer (as pipeline/run.py does), with its hidden states."""

    def __init__(self, hidden):
        super().__init__()
        self.hidden = hidden


def _stage_output(model, inputs: dict, stop_after):
    """The training loss of `model` on `inputs`, or with `stop_after` the hidden states that layer
    outputs (the forward ends there), the other outputs dropped."""
    if stop_after is None:
        return _loss_of(model(**inputs))

    def stop(module, args, output):
        raise _StageEnd(output[0] if isinstance(output, (tuple, list)) else output)

    handle = stop_after.register_forward_hook(stop)
    try:
        model(**inputs)
    except _StageEnd as end:
        return end.hidden
    finally:
        handle.remove()
    raise RuntimeError(f"{type(model).__name__}'s forward never ran its last layer")


def last_layer(model):
    """The last layer of `model`'s layer stack (its pipeline layout's last segment)."""
    from meshboost.pipeline import get_layout
    from meshboost.shardformer import pipeline_layout

    segment = get_layout(model, pipeline_layout(model)).segments[-1]
    return model.base_model.get_submodule(segment.layers)[-1]


def _loss_of(outputs):
    """The training loss of a transformers output (a base model without labels: its hidden states summed)."""
    loss = getattr(outputs, "loss", None)
    if loss is None:
        first = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state
        loss = first.float().sum()
    return loss
