"""The peak of allocated bytes over one training step, per rank, and what a device reserves beyond it.

Owns `stage_peak(...)`: the instants at which a step's live bytes can peak, each counted from what is
really alive then, and the largest of them, with `reserved` beyond it. Must not measure anything itself:
the activations' live and peak bytes come from activations.py (the real forward and backward on fake
tensors under torch's MemTracker), the states from memory.py / sharded.py.

The instants (S = weights + fp32 masters + optimizer states, alive throughout, and torch DDP's gradient
buckets where DDP reduces (zero stage 0, dp > 1, no pipeline): allocated when DDP wraps the model, they
hold a second copy of the dense gradients from the first backward on):
- backward: S + the gradients held before it (a pipeline's earlier micro-batches) + the live bytes of
  every (chunk-)micro-batch in flight but the one in backward, which adds its own peak (its saved
  tensors plus the kernels' temporaries: the loss's softmax gradient, a layer's backward buffers; with
  the gradients it has accumulated by then where the layout keeps them all through the backward: no
  ZeRO, or ZeRO-1/2 whose gradients fit one bucket, reduced when the backward ends; under checkpointing
  the first layer's recomputation, at the end, is then the peak) + a pipeline's sends not yet waited
  for (every finished unit's output and input gradient: the schedule waits for its sends at the step's
  end), each backward of the schedule's own order;
- reduction (end of backward): S + the working gradients not yet reduced (all of them without ZeRO;
  ZeRO's largest bucket in flight) + the communication buffers (`buffers`, DDP's counted in S);
- optimizer step: S + the gradients kept (ZeRO-1/2: the reduced shards) + their fp32 copies (the
  masters' gradients, half precision) + AdamW's temporaries, which differ by device: on CPU torch runs
  the single-tensor loop (the square root of one moment and its quotient, while the previous master's
  quotient is still bound: the largest previous + 2 x current over the masters in order), on CUDA the
  foreach kernels (one square root of every moment of the group: 1 x the master
  elements); ZeRO's write-back then gathers
  the working shard into a full bucket (unless the masters are the weights' own slices).

`reserved` (CUDA): the caching allocator rounds each block up (512 B, 2 MiB segments above 1 MiB) and
keeps freed blocks cached, so a margin over the peak (RESERVE_MARGIN, to be measured on a GPU) plus
the CUDA context and NCCL's buffers, outside the allocator (OUTSIDE_BYTES). On CPU tensors come from
the system allocator: reserved is the peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshboost.optim.precision import PRECISION_BYTES as BYTES
from meshboost.plan import fsdp_peak

DEVICES = ("cpu", "cuda")
RESERVE_MARGIN = {"cpu": 0.0, "cuda": 0.05}       # fraction of the peak the allocator keeps beyond it
OUTSIDE_BYTES = {"cpu": 0, "cuda": 1 << 30}       # CUDA context + NCCL communicator buffers (per process)


@dataclass(frozen=True)
class StepShape:
    """What the optimizer step and the gradient reduction of one rank touch: `numel` local elements,
    `owned` master elements (ZeRO's shards, else numel), `adam_pair` the most elements CPU AdamW's
    loop holds in temporaries (`_adam_pair` over the masters in step order: ZeRO's bucket shards, else
    the parameters), the largest ZeRO bucket (padded elements)."""

    numel: int
    owned: int
    adam_pair: int
    largest_bucket: int = 0
    buckets: int = 0                # ZeRO-1/2's buckets (0: no ZeRO-1/2 over dp > 1)


@dataclass(frozen=True)
class StageActivations:
    """One rank's activation-side bytes at its backward instants, each the peak of one unit's backward
    (its live bytes plus the kernels' temporaries) plus what else is alive then: the other chunk-micro-
    batches in flight and the sends not yet waited for. `first`: at the rank's first backward (no
    gradient held yet); `later`: the largest over its later ones (None: there are none), beside which
    the gradients of the earlier backwards are held; `first_grads`: `first` with the unit's own
    backward peak taken with the gradients it has accumulated by each instant (a layout that keeps them)."""

    first: int
    later: int | None
    first_grads: int


def adam_temporaries(device: str, shape: StepShape) -> int:
    """AdamW's temporaries at its step (fp32), by device: see the module's docstring."""
    if device == "cuda":
        return 4 * shape.owned
    return 4 * shape.adam_pair


def _adam_pair(sizes: list[int]) -> int:
    """The CPU loop's temporaries at master i (elements): its moment's square root and their quotient,
    while the previous master's quotient is still bound (`denom`, rebound once the new one exists)."""
    return max((prev + 2 * size for prev, size in zip([0, *sizes], sizes)), default=0)


def stage_peak(layout, state: dict, buffers: int, act: StageActivations, shape: StepShape,
               device: str = "cpu") -> dict:
    """{peak, reserved, outside, instant, instants} of one rank: allocated bytes at the step's worst
    instant, what the allocator reserves beyond it, what the process holds outside it."""
    if device not in DEVICES:
        raise ValueError(f"device {device!r}: the peak model predicts one of {DEVICES}")
    from meshboost.plan.memory import resident_buffers

    w = BYTES[layout.precision]
    held = state["weights"] + state["masters"] + state["optimizer_states"]
    offload_elsewhere = layout.cpu_offload and device != "cpu"
    if offload_elsewhere:                        # masters and moments live on the host
        held = state["weights"]
    elif layout.cpu_offload:                     # on a CPU the host is the device: they count
        held = state["weights"] + state.get("host", 0)
    resident = resident_buffers(buffers, layout.zero, layout.pp)
    held += resident
    half = layout.precision != "fp32"
    zero_12 = layout.zero in (1, 2) and layout.grad_replicas > 1
    working_grads = w * shape.numel
    if layout.zero == 3:                         # FSDP2: fp32 sharded gradients, reduced per unit
        working_grads = state["gradients"]
    # the gradients accumulate during the backward and stay: no ZeRO; ZeRO-1/2 in a pipeline (reduced after
    # the schedule) or with one bucket (reduced at the backward's end); else each bucket goes when it is full
    keeps = layout.zero == 0 or (zero_12 and (layout.pp > 1 or shape.buckets == 1))
    backward = held + (act.first_grads if keeps else act.first)
    if act.later is not None:                    # a later backward: the earlier ones' gradients are held
        backward = max(backward, held + working_grads + act.later)
    # ZeRO reducing in backward (stage 2; stage 1 overlapped, outside a pipeline): the largest bucket's
    # gradients (padded: at most dp elements more), the others reduced by then; else every bucket's
    # gradients are alive when the first is reduced
    in_backward = layout.zero == 2 or layout.pp == 1
    unreduced = w * shape.largest_bucket if zero_12 and in_backward else working_grads
    reduction = held + unreduced + buffers - resident
    # the fp32 gradient shards (offloaded: on the host, a copy even in fp32)
    master_grads = 4 * shape.owned if (half or layout.cpu_offload) and layout.zero != 3 and not offload_elsewhere else 0
    # ZeRO-1/2 step on the reduced shards: each bucket's working gradients are freed once reduce-scattered
    # (zero.py's `_reduce_bucket`), in backward or, ZeRO-1 under a pipeline, at step() before the inner step
    kept = w * shape.owned if zero_12 else state["gradients"]
    step = held + kept + master_grads + (0 if offload_elsewhere else adam_temporaries(device, shape))
    write_back = 0
    if zero_12 and (half or layout.cpu_offload):
        write_back = held + kept + master_grads + w * (shape.owned + shape.largest_bucket)
    return finish({"backward": backward, "reduction": reduction, "step": step, "write_back": write_back}, device)


def finish(instants: dict, device: str) -> dict:
    """The record of a rank whose instants' bytes are `instants`: the largest, and what the allocator
    reserves beyond it."""
    instant = max(instants, key=instants.get)
    peak = instants[instant]
    reserved = int(peak * (1 + RESERVE_MARGIN[device]))
    return {"peak": int(peak), "reserved": reserved, "outside": OUTSIDE_BYTES[device], "instant": instant,
            "device": device, "instants": {k: int(v) for k, v in instants.items()}}


def step_shape(layout, shards, dp_rank: int) -> StepShape:
    """The StepShape of a rank holding `shards` (meshboost's ZeRO buckets, FSDP2's shards, or whole)."""
    from meshboost.plan import memory, sharded

    numel = sum(s.numel for s in shards)
    if layout.zero == 3:
        groups = sharded.fsdp_groups(layout, shards, dp_rank)       # dense over dp (HSDP: dp_shard), experts edp
        local = [sharded.fsdp_local_numel(s, n, i) for g, n, i in groups for s in g]
        return StepShape(numel, sum(local), _adam_pair(local))
    if layout.zero in (1, 2) and layout.grad_replicas > 1:
        buckets = memory.zero_buckets(shards, layout.grad_replicas, dp_rank, layout.ep)
        owned = [-(-n // size) for n, size, _, _ in buckets]
        padded = [o * size for o, (_, size, _, _) in zip(owned, buckets)]
        return StepShape(numel, sum(owned), _adam_pair(owned), max(padded, default=0), len(buckets))
    return StepShape(numel, numel, _adam_pair([s.numel for s in shards]))


def stage_activations(planner, layout, pp_rank: int) -> StageActivations:
    """The StageActivations of pipeline rank `pp_rank`, walking the schedule's own order (1F1B or
    interleaved, `schedule_order`): at each backward unit, the live bytes of every other unit in flight
    (forward run, backward not yet), the sends still queued and the unit's own backward peak. A unit
    of the last virtual stage holds the head and the loss (the whole model's figures); any other its
    layers and the boundary tensors (the base model's: its input, received or embedded, and its output,
    kept for the next stage's gradient). Sends are waited for only at the end of the step (StageComm's
    `wait_sends`), so each finished unit leaves its output (not on the last virtual stage) and its
    input's gradient (not on the first) in the queue: `boundary_bytes` each."""
    from meshboost.pipeline import split_layers
    from meshboost.pipeline.schedule import schedule_order

    P, V = layout.pp, layout.num_model_chunks
    last_virtual = P * V - 1
    model = planner._activation_model(layout, body=P > 1 and (V > 1 or pp_rank < P - 1), pp_rank=pp_rank)
    ranges = split_layers(planner.num_layers, P * V)

    def live(v: int) -> int:
        if v == last_virtual:
            return len(ranges[v]) * model.live_per_layer + model.live_ends
        return len(ranges[v]) * model.body_live_per_layer + model.body_live_ends

    def peak(v: int, grads: bool = False) -> int:
        if v == last_virtual:
            per_layer, ends = ((model.grads_peak_per_layer, model.grads_peak_ends) if grads
                               else (model.peak_per_layer, model.peak_ends))
        else:
            per_layer, ends = ((model.body_grads_peak_per_layer, model.body_grads_peak_ends) if grads
                               else (model.body_peak_per_layer, model.body_peak_ends))
        best = max(len(ranges[v]) * per_layer + ends, live(v))
        return max(best, peak(v)) if grads else best

    boundary = boundary_bytes(planner, layout)
    lives = {chunk * P + pp_rank: live(chunk * P + pp_rank) for chunk in range(V)}
    peaks = {v: peak(v) for v in lives}
    in_flight: dict[tuple[int, int], int] = {}
    held = 0                    # the live bytes of the units in `in_flight` (a running sum: one walk, not one per unit)
    queued, instants, first_grads = 0, [], None
    for kind, chunk, mb in schedule_order(P, pp_rank, layout.microbatches if P > 1 else 1, V):
        v = chunk * P + pp_rank
        if kind == "F":
            in_flight[(chunk, mb)] = v
            held += lives[v]
            continue
        held -= lives[in_flight.pop((chunk, mb))]
        others = held + queued * boundary
        instants.append(others + peaks[v])
        if first_grads is None:
            first_grads = others + peak(v, grads=True)
        queued += (v != last_virtual) + (v != 0)
    return StageActivations(instants[0], max(instants[1:]) if len(instants) > 1 else None, first_grads)


def boundary_bytes(planner, layout) -> int:
    """Bytes of one micro-batch's hidden states crossing a stage boundary, and of their gradient sent
    back: its sequences x this rank's tokens (context parallelism: its piece; sequence parallelism: 1/tp
    of them) x hidden, in the working precision. (A boundary carrying more, an encoder's output to the
    decoder stages, is not counted.)"""
    tokens = planner.seq // layout.cp if layout.cp > 1 else planner.seq
    if layout.sequence_parallel and layout.tp > 1:
        tokens //= layout.tp
    return layout.microbatch_size * tokens * planner.hidden * BYTES[layout.precision]


def rank_peak(planner, layout, pp_rank: int, shards, dp_rank: int, mem: dict) -> dict:
    """`stage_peak` of one rank of `planner`'s layout whose state and buffers are `mem` (ZeRO-3:
    fsdp_peak.py's instants)."""
    act = planner.stage_peak_activations(layout, pp_rank)
    if layout.zero == 3:
        adam = adam_temporaries(planner.device, step_shape(layout, shards, dp_rank))
        instants = (fsdp_peak.rank_instants(planner, layout, shards, dp_rank, mem, act.first, adam) if layout.pp == 1
                    else fsdp_peak.pipeline_instants(planner, layout, shards, dp_rank, mem, act, adam))
        return finish(instants, planner.device)
    return stage_peak(layout, mem, mem["buffers"], act, step_shape(layout, shards, dp_rank), planner.device)


def needed_bytes(memory: dict) -> int:
    """Device bytes a rank needs: what the allocator reserves at the peak plus what lies outside it."""
    return memory["reserved"] + memory["outside"]
