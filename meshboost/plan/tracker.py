"""torch's MemTracker as the planner and its meter read it: live bytes and their peak, nothing else.

Owns: `live_bytes_tracker()` (MemTracker without its per-module statistics and without the module
hooks behind them) and `device_bytes` (a snapshot's bytes over the devices that hold memory). Must
not interpret what it counts: activations.py (the fake runs) and benchmarks/plan_peak.py (the real
step) do.

Why no module hooks. MemTracker's ModTracker hooks every module's forward and registers, on each input
that requires a gradient, a hook on the tensor's autograd node; on a leaf that node is the leaf's
gradient accumulator, which holds the leaf, and the hook's closure holds the node: a cycle through
C++ that Python's collector cannot see. A pipeline stage's received activations are such leaves, so
under the tracker every one of them (and its gradient, the one sent back) stayed alive until the
process ended, bytes the untracked step frees at each micro-batch's backward (2 x 49 KB per
micro-batch on BERT's last stage, case 14). The tracker needs none of it: whether an op runs in
backward (its `Temp` category) comes from the autograd engine (`ModTracker.is_bw`), and the
per-module statistics the hooks feed are not read. Without them a fake run is also faster (a
pipeline runs each module once per micro-batch, which the module snapshots refuse anyway).

Why meta is left out. A pipeline stage starting inside a segment runs that segment's embeddings as a
weightless copy on the meta device for their output shape (pipeline/stand_ins.py); MemTracker counts
those tensors under a device of their own, and its peak snapshot holds each device's own peak, from
different instants: summing them added bytes no device holds (414 KB on BERT's last stage).
"""

from __future__ import annotations

from functools import lru_cache

NO_MEMORY = ("meta",)        # devices whose tensors hold no bytes


@lru_cache(maxsize=None)
def live_bytes_tracker() -> type:
    """torch's `MemTracker` counting live bytes and their peak, without module hooks (see above)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    class Unhooked(ModTracker):
        """`is_bw` (asked of the autograd engine) without the module hooks that leak leaves."""

        def __enter__(self):
            return self

        def __exit__(self, *args):
            pass

    class LiveBytesTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._mod_tracker = Unhooked()

    return LiveBytesTracker


def device_bytes(snapshot: dict, kinds=("Total",)) -> int:
    """The bytes of `kinds` (MemTracker's category names, or "Total") in a MemTracker snapshot
    ({device: {category: bytes}}), over the devices that hold memory."""
    return sum(snap.get(k, 0) for device, snap in snapshot.items() if str(device) not in NO_MEMORY
               for k in kinds)
