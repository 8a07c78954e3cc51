"""One fake training step of a model under torch's MemTracker: the bytes alive after its forward and
after each op of forward and backward, and the gradient bytes accumulated by each op.

Owns `live_peak` (the run and its timeline) and `last_layer` (where a pipeline stage that is not the
last ends its forward). Must not decide what the figures mean for a layout (activations.py, peak.py)
nor build the model or its inputs (activations.py does, on fake tensors).
"""

from __future__ import annotations

from array import array
from functools import partial

import torch


def live_peak(model, inputs: dict, hooks, stop_after=None) -> tuple[int, array, array]:
    """(bytes alive once the forward has returned its loss, the bytes alive after each op of that
    forward and the backward: its maximum is the peak, the gradient bytes accumulated by each op), the
    parameters and their gradients left out of the first two,
    on `model`'s fake tensors, as torch's `MemTracker` counts them (each storage once, whatever views
    autograd saved of it). The outputs but the loss are dropped, as a training step drops them (the
    logits are not saved: the loss's softmax is); each gradient is dropped once accumulated (they are
    counted as `gradients`, held or reduced as the layout does: the third timeline says how many a step
    holds by each op when it keeps them), so the peak is what activations and the kernels' temporaries add.
    `stop_after`: `model` is a pipeline stage that is not the last, whose forward stops after this layer
    (no final norm, no pooler: pipeline/run.py) and sends its output on: the output is kept until the
    next stage's gradient of it arrives (the schedule's `saved`), and that gradient seeds the backward."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    from meshboost.plan.tracker import device_bytes, live_bytes_tracker

    kinds = (_MemRefType.ACT, _MemRefType.TEMP)
    accumulated: dict[int, int] = {}            # id(parameter) -> its gradient's bytes
    drops = [p.register_post_accumulate_grad_hook(partial(_drop_grad, accumulated))
             for p in model.parameters() if p.requires_grad]

    class Timeline(live_bytes_tracker()):
        """MemTracker, noting its live activation and temporary bytes after each op (an allocation is
        where a peak happens), and the gradient bytes accumulated by then: one op sequence at two batch
        sizes gives every instant's bytes as an affine function of the batch (activations.py's
        `_extrapolated`)."""

        def __init__(self):
            super().__init__()
            self.totals: list[int] = []
            self.grads: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.totals.append(device_bytes(self._curr_mem_snap, kinds))
            self.grads.append(sum(accumulated.values()))
            return out

    tracker = Timeline()
    tracker.track_external(model)
    try:
        with tracker:
            with hooks():
                root = _stage_output(model, inputs, stop_after)
            after = tracker.get_tracker_snapshot("current")
            root.backward(torch.empty_like(root) if stop_after is not None else None)
    finally:
        for handle in drops:
            handle.remove()
    # the timelines as 8-byte integers: the planner caches them per fake run (hundreds, ~2000 ops each)
    return device_bytes(after, kinds), array("q", tracker.totals), array("q", tracker.grads)


def _drop_grad(accumulated: dict, p) -> None:
    accumulated[id(p)] = p.grad.numel() * p.grad.element_size()
    p.grad = None


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
