"""The peak of allocated bytes over one training step, per rank, and what a device reserves beyond it.

Owns `stage_peak(...)`: the instants at which a step's live bytes can peak, each counted from what is
really alive then, and the largest of them, with `reserved` beyond it. Must not measure anything itself:
the activations' live and peak bytes come from activations.py (the real forward and backward on fake
tensors under torch's MemTracker), the states from memory.py / sharded.py.

The instants (S = weights + fp32 masters + optimizer states, alive throughout):
- backward: S + the gradients held before it (a pipeline's earlier micro-batches) + the live bytes of
  every micro-batch in flight but the one in backward, which adds its own peak (its saved tensors plus
  the kernels' temporaries: the loss's softmax gradient, a layer's backward buffers);
- reduction (end of backward): S + the working gradients not yet reduced (all of them without ZeRO;
  ZeRO's bucket in flight) + the communication buffers (`buffers`);
- optimizer step: S + the gradients kept + their fp32 copies (the masters' gradients, half precision)
  + AdamW's temporaries, which differ by device: on CPU torch runs the single-tensor loop (the square
  root of one moment and its quotient: 2 x the largest master tensor), on CUDA the foreach kernels (one
  square root of every moment of the group: 1 x the master elements); ZeRO's write-back then gathers
  the working shard into a full bucket (unless the masters are the weights' own slices).

`reserved` (CUDA): the caching allocator rounds each block up (512 B, 2 MiB segments above 1 MiB) and
keeps freed blocks cached, so a margin over the peak (RESERVE_MARGIN, to be measured on a GPU) plus
the CUDA context and NCCL's buffers, outside the allocator (OUTSIDE_BYTES). On CPU tensors come from
the system allocator: reserved is the peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshboost.optim.precision import PRECISION_BYTES as BYTES
from meshboost.optim.zero_config import DEFAULT_BUCKET_ELEMENTS

DEVICES = ("cpu", "cuda")
RESERVE_MARGIN = {"cpu": 0.0, "cuda": 0.05}       # fraction of the peak the allocator keeps beyond it
OUTSIDE_BYTES = {"cpu": 0, "cuda": 1 << 30}       # CUDA context + NCCL communicator buffers (per process)


@dataclass(frozen=True)
class StepShape:
    """What the optimizer step and the gradient reduction of one rank touch: `numel` local elements,
    `owned` master elements (ZeRO's shards, else numel), the largest single master tensor (a ZeRO
    bucket's shard, else the largest parameter), the largest ZeRO bucket (padded elements)."""

    numel: int
    owned: int
    largest_master: int
    largest_bucket: int = 0


@dataclass(frozen=True)
class StageActivations:
    """One stage's activations at its backward instants: the live bytes of the other micro-batches in
    flight at the first backward and at a later one (None: no later backward, one micro-batch), and the
    peak one micro-batch's backward reaches (its live bytes plus its temporaries)."""

    others_first: int
    others_later: int | None
    one_peak: int


def adam_temporaries(device: str, shape: StepShape) -> int:
    """AdamW's temporaries at its step (fp32), by device: see the module's docstring."""
    if device == "cuda":
        return 4 * shape.owned
    return 2 * 4 * shape.largest_master


def stage_peak(layout, state: dict, buffers: int, act: StageActivations, shape: StepShape,
               device: str = "cpu") -> dict:
    """{peak, reserved, outside, instant, instants} of one rank: allocated bytes at the step's worst
    instant, what the allocator reserves beyond it, what the process holds outside it."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: the peak model predicts one of {DEVICES}")
    w = BYTES[layout.precision]
    held = state["weights"] + state["masters"] + state["optimizer_states"]
    offload_elsewhere = layout.cpu_offload and device != "cpu"
    if offload_elsewhere:                        # masters and moments live on the host
        held = state["weights"]
    elif layout.cpu_offload:                     # on a CPU the host is the device: they count
        held = state["weights"] + state.get("host", 0)
    half = layout.precision != "fp32"
    zero_12 = layout.zero in (1, 2) and layout.grad_replicas > 1
    working_grads = w * shape.numel
    if layout.zero == 3:                         # FSDP2: fp32 sharded gradients, reduced per unit
        working_grads = state["gradients"]
    backward = held + act.others_first + act.one_peak
    if act.others_later is not None:            # a later micro-batch: the earlier ones' gradients are held
        backward = max(backward, held + working_grads + act.others_later + act.one_peak)
    unreduced = w * min(shape.numel, DEFAULT_BUCKET_ELEMENTS) if zero_12 else working_grads
    reduction = held + unreduced + buffers
    # the fp32 gradient shards (offloaded: on the host, a copy even in fp32)
    master_grads = 4 * shape.owned if (half or layout.cpu_offload) and layout.zero != 3 and not offload_elsewhere else 0
    kept = state["gradients"]
    step = held + kept + master_grads + (0 if offload_elsewhere else adam_temporaries(device, shape))
    write_back = 0
    if zero_12 and (half or layout.cpu_offload):
        write_back = held + kept + master_grads + w * (shape.owned + shape.largest_bucket)
    instants = {"backward": backward, "reduction": reduction, "step": step, "write_back": write_back}
    instant = max(instants, key=instants.get)
    peak = instants[instant]
    reserved = int(peak * (1 + RESERVE_MARGIN[device]))
    return {"peak": int(peak), "reserved": reserved, "outside": OUTSIDE_BYTES[device], "instant": instant,
            "device": device, "instants": {k: int(v) for k, v in instants.items()}}


def default_device() -> str:
    """The device a plan predicts when none is named: CUDA where torch sees one, else the CPU."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def step_shape(layout, shards, dp_rank: int) -> StepShape:
    """The StepShape of a rank holding `shards` (meshboost's ZeRO buckets, FSDP2's shards, or whole)."""
    from meshboost.plan import memory, sharded

    numel = sum(s.numel for s in shards)
    if layout.zero == 3:
        groups = sharded.fsdp_groups(layout, shards, dp_rank)       # dense over dp (HSDP: dp_shard), experts edp
        local = [sharded.fsdp_local_numel(s, n, i) for g, n, i in groups for s in g]
        return StepShape(numel, sum(local), max(local, default=0))
    if layout.zero in (1, 2) and layout.grad_replicas > 1:
        buckets = memory.zero_buckets(shards, layout.grad_replicas, dp_rank, layout.ep)
        owned = [-(-n // size) for n, size, _, _ in buckets]
        padded = [o * size for o, (_, size, _, _) in zip(owned, buckets)]
        return StepShape(numel, sum(owned), max(owned, default=0), max(padded, default=0))
    return StepShape(numel, numel, max((s.numel for s in shards), default=0))


def stage_activations(planner, layout, pp_rank: int) -> StageActivations:
    """The StageActivations of pipeline rank `pp_rank`: the planner's saved bytes in flight, turned
    into live bytes by the measured ratio (each storage once), and one micro-batch's peak."""
    last = pp_rank == layout.pp - 1
    if layout.num_model_chunks > 1:
        return _interleaved_activations(planner, layout, pp_rank)
    model = planner._activation_model(layout, body=not last, pp_rank=pp_rank)
    layers = planner.layer_counts(layout)[pp_rank]
    one_saved = layers * model.per_layer + (model.ends if last else 0)
    if last:
        one_live = layers * model.live_per_layer + model.live_ends
        one_peak = layers * model.peak_per_layer + model.peak_ends
    else:       # its output kept for the next stage's gradient, one of its layers' backward at the peak
        one_live = layers * model.body_live_per_layer + model.body_live_ends
        one_peak = layers * model.body_peak_per_layer + model.body_peak_ends
    in_flight = round(planner.stage_activations(layout, pp_rank) / max(one_saved, 1))
    later = None
    if layout.pp > 1 and layout.microbatches > 1:     # 1F1B: one more forward before the next backward, if any remain
        later = (in_flight if layout.microbatches > in_flight else in_flight - 1) - 1
    return StageActivations((in_flight - 1) * one_live, None if later is None else later * one_live,
                            max(one_peak, one_live))


def _interleaved_activations(planner, layout, pp_rank: int) -> StageActivations:
    """The interleaved schedule's: `units` chunk-micro-batches in flight at the first backward (the
    planner's count: W + 1, W = 2 (pp - rank - 1) + (V - 1) pp warm-up forwards), each a chunk of
    layers / V layers run as a non-last stage (its output kept), but on the last rank one of them may
    be the last chunk's, with the head and the loss (the larger live bytes and peak then)."""
    chunks, last = layout.num_model_chunks, pp_rank == layout.pp - 1
    model = planner._activation_model(layout, body=True)
    chunk_layers = planner.layer_counts(layout)[pp_rank] // chunks
    units = min(2 * (layout.pp - pp_rank - 1) + (chunks - 1) * layout.pp + 1, layout.microbatches * chunks)
    unit_live = chunk_layers * model.body_live_per_layer + model.body_live_ends
    unit_peak = chunk_layers * model.body_peak_per_layer + model.body_peak_ends
    extra = 0
    if last:                # the head's chunk: live_ends and peak_ends (with the loss) in place of the body's
        extra = max(0, chunk_layers * model.live_per_layer + model.live_ends - unit_live)
        unit_peak = max(unit_peak, chunk_layers * model.peak_per_layer + model.peak_ends)
    later = max(units - 2, 0) * unit_live + extra if layout.microbatches * chunks > 1 else None
    return StageActivations((units - 1) * unit_live + extra, later, max(unit_peak, unit_live))


def rank_peak(planner, layout, pp_rank: int, shards, dp_rank: int, mem: dict) -> dict:
    """`stage_peak` of one rank of `planner`'s layout whose state and buffers are `mem`."""
    act = stage_activations(planner, layout, pp_rank)
    return stage_peak(layout, mem, mem["buffers"], act, step_shape(layout, shards, dp_rank), planner.device)


def needed_bytes(memory: dict) -> int:
    """Device bytes a rank needs: what the allocator reserves at the peak plus what lies outside it."""
    return memory["reserved"] + memory["outside"]
