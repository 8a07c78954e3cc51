"""What a fake training step holds alive, op by op, as torch's `MemTracker` counts it.

Owns `live_peak`: a model's forward and backward on fake tensors under MemTracker, with the bytes of
activations and temporaries alive after each op (the timeline whose maximum is a micro-batch's peak)
and, beside it, the gradient bytes accumulated by then (each parameter once: a layout that keeps its
working gradients through the backward holds them on top, peak.py); `live_bytes_tracker`, the tracker
without its per-module statistics. activations.py runs it on the planner's fake models. Must not keep
a gradient: each is dropped once accumulated (its bytes noted), as the gradients are counted apart.
"""

from __future__ import annotations

from array import array
from functools import lru_cache, partial


@lru_cache(maxsize=None)
def live_bytes_tracker() -> type:
    """torch's `MemTracker` without its per-module statistics, for reading live bytes and their peak
    only: its module hooks cost half of a fake run and change no figure, and a pipeline runs each module
    once per micro-batch, which its module snapshots refuse (they are for one call per iteration)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class LiveBytesTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    return LiveBytesTracker


def live_peak(model, inputs: dict, hooks, body: bool = False) -> tuple[int, array, array]:
    """(bytes alive once the forward has returned its loss, the bytes alive after each op of that
    forward and the backward: its maximum is the peak, the gradient bytes accumulated by each op), the
    parameters and their gradients left out of the first two, on `model`'s fake tensors, as torch's
    `MemTracker` counts them (each storage once, whatever views autograd saved of it). The outputs
    but the loss are dropped, as a training step drops them (the logits are not saved: the loss's
    softmax is); each gradient is dropped once accumulated (they are counted as `gradients`, held or
    reduced as the layout does: the third timeline says how many a step holds by each op when it keeps
    them), so the peak is what activations and the kernels' temporaries add.
    `body`: `model` is a stage that sends its output on: the output is kept until the next stage's
    gradient of it arrives (the schedule's `saved`), and that gradient seeds the backward."""
    import torch
    from torch.distributed._tools.mem_tracker import _MemRefType

    kinds = (_MemRefType.ACT, _MemRefType.TEMP)
    accumulated: dict[int, int] = {}            # id(parameter) -> its gradient's bytes
    drops = [p.register_post_accumulate_grad_hook(partial(_drop_grad, accumulated))
             for p in model.parameters() if p.requires_grad]

    class Timeline(live_bytes_tracker()):
        """MemTracker, noting its live activation and temporary bytes after each op (an allocation is
        where a peak happens), and the gradient bytes accumulated by then: one op sequence at two batch
        sizes gives every instant's bytes as an affine function of the batch (`_extrapolated`)."""

        def __init__(self):
            super().__init__()
            self.totals: list[int] = []
            self.grads: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.totals.append(sum(snap.get(k, 0) for snap in self._curr_mem_snap.values() for k in kinds))
            self.grads.append(sum(accumulated.values()))
            return out

    tracker = Timeline()
    tracker.track_external(model)
    try:
        with tracker:
            with hooks():
                outputs = model(**inputs)
                root = outputs[0] if body else _loss_of(outputs)
            del outputs
            after = tracker.get_tracker_snapshot("current")
            root.backward(torch.empty_like(root) if body else None)
    finally:
        for handle in drops:
            handle.remove()
    # the timelines as 8-byte integers: the planner caches them per fake run (hundreds, ~2000 ops each)
    return (sum(snap.get(k, 0) for snap in after.values() for k in kinds), array("q", tracker.totals),
            array("q", tracker.grads))


def _drop_grad(accumulated: dict, p) -> None:
    accumulated[id(p)] = p.grad.numel() * p.grad.element_size()
    p.grad = None


def _loss_of(outputs):
    """The training loss of a transformers output (a base model without labels: its hidden states summed)."""
    loss = getattr(outputs, "loss", None)
    if loss is None:
        first = outputs[0] if isinstance(outputs, tuple) else outputs.last_hidden_state
        loss = first.float().sum()
    return loss
