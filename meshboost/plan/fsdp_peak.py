"""ZeRO-3's peak (torch FSDP2 under HybridParallelPlugin(zero_stage=3); inside a pipeline:
`pipeline_instants`): the instants of one step at which a rank's live bytes can peak, each counted
from what FSDP2 really holds then.

Owns: the per-unit sizes FSDP2 allocates (`FsdpShape`) and the backward instants built from them. Read
from torch's `_fsdp_param_group.py` / `_fsdp_collectives.py` (units: the root, holding embeddings,
final norm and head, and one per transformer layer, each with w = the compute dtype's bytes and G_u =
its padded unsharded elements, dp x ceil(d0/dp) rows of every tp-local parameter):
- the root's gathered weights (w G_root) stay from its forward to its post-backward (meshboost leaves
  its reshard_after_forward to FSDP2: the root is not resharded); each layer is gathered again for its
  backward (per-parameter outputs, w G), and its pre-backward prefetches the next layer in backward
  order into one flat all-gather output (w G); the root's pre-backward, at the start of backward,
  prefetches the last layer so;
- autograd's unsharded gradients (w x the unit's unpadded elements) live until the unit's
  post-backward: the head-side root weights' (those used after the layers: final norm, LM head, a tied
  input embedding) through every layer's backward;
- a unit's post-backward reshards it, copies its gradients into the fp32 reduce-scatter input (4 G,
  reduce_dtype), frees them, and reduce-scatters into a padded fp32 shard (4 G / dp) that stays as the
  sharded gradient; the input is kept until the next unit's post-backward (reduce_scatter_states, at
  most 1 by default). On CPU, gloo's reduce-scatter copies its whole input once more while it runs
  (measured: 1 x the input bytes); NCCL does not.
Activations come from the fake runs (activations.py): the whole model's peak at the loss, and the base
model's (`body`: no head, its output and gradient kept) for the layers' backward: live bytes of k layers
at a layer's reduce-scatter, the peak of k + 1 at layer k's backward. A layer's backward is counted with
all its unsharded gradients and its peak activations at once (an upper bound: as its gradients appear
its saved tensors go). Must not measure anything itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshboost.plan.memory import BYTES
from meshboost.plan.sharded import (REDUCE_BYTES, SHARD_BYTES, dense_shard_index, fsdp_local_numel, fsdp_padded_numel,
                                    fsdp_units)


@dataclass(frozen=True)
class Unit:
    """One FSDP2 unit on one rank: `gathered` padded unsharded elements (the all-gather's output, the
    reduce-scatter's input), `grads` unpadded tp-local elements (autograd's unsharded gradients),
    `shard` padded elements of this rank's reduced gradient (gathered / dp)."""

    gathered: int
    grads: int
    shard: int


@dataclass(frozen=True)
class FsdpShape:
    """The root, the layers in forward order, the root's head-side gradient elements (alive through
    the layers' backward) and the padding bytes of this rank's fp32 weight shards."""

    root: Unit
    layers: tuple[Unit, ...]
    head_grads: int
    weight_padding: int


def head_side(meta, layer_prefixes) -> set[str]:
    """Names of the root's parameters used after the layers (their gradients exist from the head's
    backward on): those `named_parameters(remove_duplicate=False)` lists after the last layer's, a tied
    input embedding by its first name."""
    prefixes = tuple(p + "." for p in layer_prefixes)
    first: dict[int, str] = {}
    order = list(meta.named_parameters(remove_duplicate=False))
    for name, p in order:
        first.setdefault(id(p), name)
    last = max((i for i, (name, _) in enumerate(order) if name.startswith(prefixes)), default=-1)
    return {first[id(p)] for _, p in order[last + 1:]} if prefixes else set()


def fsdp_shape(shards, dp_size: int, dp_rank: int, layer_prefixes, head_names: set[str]) -> FsdpShape:
    """The `FsdpShape` of a rank holding `shards`, cut `dp_size` ways (the dense shard group's size)."""
    def unit(group) -> Unit:
        gathered = sum(fsdp_padded_numel(s, dp_size) * dp_size for s in group)
        return Unit(gathered, sum(s.numel for s in group), gathered // dp_size)

    units = fsdp_units(shards, layer_prefixes)
    root, layers = units[0], units[1:]
    pad = sum(fsdp_padded_numel(s, dp_size) - fsdp_local_numel(s, dp_size, dp_rank) for s in shards)
    return FsdpShape(unit(root), tuple(unit(u) for u in layers),
                     sum(s.numel for s in root if s.name in head_names), SHARD_BYTES * pad)


def backward_instants(shape: FsdpShape, precision: str, held: int, whole_peak: int, body: tuple,
                      device: str) -> dict:
    """{instant: bytes} over one backward: `held` (fp32 shards and moments), `whole_peak` (one
    micro-batch's peak activations, the whole model), `body` = (live per layer, live ends, peak per
    layer, peak ends) of the base model; the instants named as peak.py's ('backward': the loss and the
    layers, 'reduction': the reduce-scatters)."""
    w = BYTES[precision]
    rs_copy = 1 if device == "cpu" else 0          # gloo's copy of the reduce-scatter input
    live_layer, live_ends, peak_layer, peak_ends = body
    root, layers = shape.root, shape.layers
    base = held + shape.weight_padding + w * root.gathered
    last = len(layers) - 1
    loss = base + whole_peak + (w * layers[-1].gathered if layers else 0)
    worst_layer = worst_rs = 0
    reduced = 0                                     # fp32 sharded gradients of the layers done
    for k in range(last, -1, -1):
        unit = layers[k]
        prefetched = w * layers[k - 1].gathered if k > 0 else 0
        earlier_rs = REDUCE_BYTES * layers[k + 1].gathered if k < last else 0
        during = (base + reduced + w * shape.head_grads + w * unit.gathered + prefetched + earlier_rs
                  + w * unit.grads + (k + 1) * peak_layer + peak_ends)
        rs = (base + reduced + w * shape.head_grads + prefetched + REDUCE_BYTES * unit.gathered * (1 + rs_copy)
              + REDUCE_BYTES * unit.shard + k * live_layer + live_ends)
        worst_layer, worst_rs = max(worst_layer, during), max(worst_rs, rs)
        reduced += REDUCE_BYTES * unit.shard
    # the embedding's backward (layer 0's reduce-scatter input still kept, all the root's gradients),
    # then the root's post-backward: resharded, its gradients copied in and freed
    first_rs = REDUCE_BYTES * layers[0].gathered if layers else 0
    embedding = base + reduced + first_rs + w * root.grads + live_ends
    root_rs = (held + shape.weight_padding + reduced + REDUCE_BYTES * root.gathered * (1 + rs_copy)
               + REDUCE_BYTES * root.shard)
    return {"backward": max(loss, worst_layer), "reduction": max(worst_rs, embedding, root_rs)}


def kept_gradients(shape: FsdpShape) -> int:
    """Bytes of the fp32 sharded gradients after backward, padding included (the reduce-scatter
    outputs they are views of)."""
    return REDUCE_BYTES * (shape.root.shard + sum(u.shard for u in shape.layers))


def rank_instants(planner, layout, shards, dp_rank: int, mem: dict, whole_peak: int, adam: int) -> dict:
    """{instant: bytes} of one rank of a ZeRO-3 `layout` without a pipeline: `backward_instants`, and the
    optimizer step (the kept padded gradients and `adam`, AdamW's temporaries). `whole_peak`: one
    micro-batch's peak activations (peak.py's `stage_activations`)."""
    if layout.pp != 1:
        raise ValueError("fsdp_peak models ZeRO-3 outside a pipeline")
    prefixes = planner.layer_prefixes
    shape = fsdp_shape(shards, *dense_shard_index(layout, dp_rank), prefixes, head_side(planner.meta, prefixes))
    held = mem["weights"] + mem["masters"] + mem["optimizer_states"]
    body = planner._activation_model(layout, body=True)
    instants = backward_instants(shape, layout.precision, held, whole_peak,
                                 (body.body_live_per_layer, body.body_live_ends, body.body_peak_per_layer,
                                  body.body_peak_ends), planner.device)
    instants["step"] = held + shape.weight_padding + kept_gradients(shape) + adam
    instants["write_back"] = 0
    return instants


def pipeline_instants(planner, layout, shards, dp_rank: int, mem: dict, act, adam: int) -> dict:
    """{instant: bytes} of one rank of a ZeRO-3 `layout` inside a pipeline (fsdp/pipeline.py's
    `StepSharding`): every unit stays gathered from its first forward to the step's end and the
    unsharded gradients accumulate through the schedule (gradient sync off), so a backward holds all
    of the stage's gathered weights and `act`'s (peak.py's `StageActivations`) activations. Each unit's
    post-backward without sync (torch's `to_accumulated_grad_if_needed`) turns its working-precision
    gradients into an accumulator of the reduce dtype (fp32), to which a later micro-batch's gradients
    are added there: so the first backward holds `act.first_grads` with every finished unit's gradients
    in fp32 (counted as if all had finished), a later one every unit's fp32 accumulator plus the working
    gradients of the unit in its backward (counted as the largest unit's, at the backward's own peak);
    the step's end runs each unit's post-backward in turn (the root, then the layers): the unit is
    resharded, its accumulator goes into the fp32 reduce-scatter input (4 G; gloo copies it once more
    on CPU) while the previous unit's input is still kept, and the reduced fp32 shards stay."""
    shape = fsdp_shape(shards, *dense_shard_index(layout, dp_rank), planner.layer_prefixes, set())
    w = BYTES[layout.precision]
    held = mem["weights"] + mem["masters"] + mem["optimizer_states"] + shape.weight_padding
    units = [shape.root, *shape.layers]
    gathered, elements = w * sum(u.gathered for u in units), sum(u.grads for u in units)
    grads = REDUCE_BYTES * elements              # the accumulators
    backward = held + gathered + act.first_grads + (REDUCE_BYTES - w) * elements
    if act.later is not None:                    # a later micro-batch's backward: the accumulators held
        # the unit in backward's own working gradients, bounded by the largest unit's: an upper bound where
        # the backward's peak is the loss's (the last stage: none of them exist yet there)
        backward = max(backward, held + gathered + grads + act.later + w * max(u.grads for u in units))
    copies = 2 if planner.device == "cpu" else 1
    reduction = reduced = previous = 0
    for u in units:
        gathered, grads = gathered - w * u.gathered, grads - REDUCE_BYTES * u.grads
        reduced += REDUCE_BYTES * u.shard
        reduction = max(reduction, held + gathered + grads + copies * REDUCE_BYTES * u.gathered + previous + reduced)
        previous = REDUCE_BYTES * u.gathered
    step = held + REDUCE_BYTES * sum(u.shard for u in units) + adam
    return {"backward": backward, "reduction": reduction, "step": step, "write_back": 0}
