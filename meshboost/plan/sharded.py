"""Predicted bytes of the two plugin axes that move or shard the training state outright: ZeRO-3
(HybridParallelPlugin(zero_stage=3), torch FSDP2 over dp) and ZeRO-1/2's cpu_offload.

Owns: applying FSDP2's layout (torch's `FSDPParam`) to a rank's `ParamShard`s: every tp-local
parameter is cut on dim 0 by `torch.chunk` into dp pieces of ceil(d0/dp) rows (rank r holds
max(0, min(c, d0 - r*c)) rows; fewer than dp chunks leave the last ranks empty), each stored padded to
c rows; the stored shard is fp32 whatever the precision (meshboost's MixedPrecisionPolicy: the shards
are the masters, param_dtype is the compute dtype), the reduce-scatter runs in fp32 (reduce_dtype) and
the gradient is an fp32 view of it; AdamW's moments are `zeros_like` of the unpadded local shard.
`memory_breakdown` counts the unpadded views (DTensor `_local_tensor`), so the padding rows are
returned apart (`fsdp_padding_bytes`). The units are meshboost's: one per transformer layer
(`transformer_layers`), the rest (embeddings, final norm, LM head) in the root, which FSDP2 keeps
gathered from its forward to its backward. Also the split of ZeroOptimizer's state under cpu_offload
(offload.py: master shards, always a copy, and the moments on the host; one working-dtype staging
buffer per bucket there; weights and gradients stay on the device). Must not allocate or communicate.
"""

from __future__ import annotations

import math

from meshboost.fsdp.config import FSDPConfig
from meshboost.plan.memory import ADAM_STATES, BYTES

REDUCE_BYTES = FSDPConfig.reduce_dtype.itemsize   # its default reduce_dtype: gradients reduce-scattered, kept in it
SHARD_BYTES = 4             # the sharded parameters (the masters) stay fp32


def _dim0(shard) -> tuple[int, int]:
    """(rows on dim 0, elements per row) of a ParamShard's local (tp-split) shape."""
    shape = tuple(shard.shape) or (shard.numel,)
    return shape[0], math.prod(shape[1:])


def fsdp_rows(dim0: int, dp_size: int, dp_rank: int) -> int:
    """Rows `torch.chunk(t, dp_size, dim=0)` gives dp rank `dp_rank` (FSDP2's `_chunk_with_empty`)."""
    chunk = -(-dim0 // dp_size)
    return max(0, min(chunk, dim0 - dp_rank * chunk))


def fsdp_local_numel(shard, dp_size: int, dp_rank: int) -> int:
    """Elements of `shard`'s FSDP2 piece on dp rank `dp_rank`, padding excluded (what a DTensor's
    `to_local()` and `memory_breakdown` see)."""
    rows, row = _dim0(shard)
    return fsdp_rows(rows, dp_size, dp_rank) * row


def fsdp_padded_numel(shard, dp_size: int) -> int:
    """Elements every dp rank stores for `shard` (ceil(d0/dp) rows, padding included); times dp_size it
    is the all-gather output and the reduce-scatter input."""
    rows, row = _dim0(shard)
    return -(-rows // dp_size) * row


def dense_shard_index(layout, dp_rank: int) -> tuple[int, int]:
    """(size, this rank's index) of dp rank `dp_rank`'s dense ZeRO-3 shard group: the replica coordinate
    (HSDP's dp_replicate) is outermost, so the index is `dp_rank` modulo the group."""
    size = layout.fsdp_sizes[1]
    return size, dp_rank % size


def fsdp_groups(layout, shards, dp_rank: int) -> list[tuple[list, int, int]]:
    """[(shards, shard group size, this rank's index in it)] of a rank under zero_stage=3, from the
    layout's `ParallelDims`: dense weights over their shard axes (dp x cp; HSDP's dp_shard x cp inside a
    replica group), experts over theirs (the experts' replicas edp x cp). `dp_rank` indexes the dense
    gradient group (dp x cp, cp inner), as the planner's dp ranks do."""
    from meshboost.distributed.param_info import EXPERT
    dims = layout.dims
    dense_size, dense_index = dense_shard_index(layout, dp_rank)
    expert_size = dims.size(*dims.shard_axes(EXPERT)[1])
    dp, cp = divmod(dp_rank, dims.cp)
    # the replica coordinate is outermost (dp_replicate, edp_shard, ep): modulo the group, the index inside it
    groups = [([s for s in shards if not s.expert], dense_size, dense_index),
              ([s for s in shards if s.expert], expert_size, ((dp // dims.ep) * dims.cp + cp) % expert_size)]
    return [g for g in groups if g[0]]


def fsdp_state_bytes(shards, precision: str, dp_size: int, dp_rank: int) -> dict:
    """{weights, gradients, masters, optimizer_states} bytes dp rank `dp_rank` holds after backward under
    zero_stage=3, as `memory_breakdown` counts them: the fp32 shards are the model's parameters
    (weights; the optimizer steps them, so masters are 0 in every precision), their fp32 gradients and
    AdamW's two fp32 moments, all of this rank's unpadded piece. `precision` (the compute dtype) changes
    none of them: it is the dtype of the transient gathered weights (`fsdp_buffer_bytes`)."""
    BYTES[precision]                        # an unknown precision raises, as elsewhere
    local = sum(fsdp_local_numel(s, dp_size, dp_rank) for s in shards)
    return {"weights": SHARD_BYTES * local, "gradients": REDUCE_BYTES * local, "masters": 0,
            "optimizer_states": ADAM_STATES * 4 * local}


def fsdp_padding_bytes(shards, dp_size: int, dp_rank: int) -> int:
    """Device bytes FSDP2 stores beyond what `fsdp_state_bytes` counts: each padded shard's spare rows,
    in the fp32 weights and in the fp32 reduce-scatter output the gradients are views of."""
    pad = sum(fsdp_padded_numel(s, dp_size) - fsdp_local_numel(s, dp_size, dp_rank) for s in shards)
    return (SHARD_BYTES + REDUCE_BYTES) * pad


def fsdp_units(shards, layer_prefixes) -> list[list]:
    """The shards of each FSDP2 unit: [root, layer 0, layer 1, ...]. `layer_prefixes`: the qualified names
    of the transformer layers (`transformer_layers(meta_model)`'s names, e.g. "model.layers.0"); a
    shard under none of them is the root's (meshboost also keeps a layer holding a weight shared outside
    it in the root: no HF decoder layer does)."""
    prefixes = [p + "." for p in layer_prefixes]
    units: list[list] = [[] for _ in range(len(prefixes) + 1)]
    for s in shards:
        index = next((i + 1 for i, p in enumerate(prefixes) if s.name.startswith(p)), 0)
        units[index].append(s)
    return [units[0]] + [u for u in units[1:] if u]


def fsdp_buffer_bytes(shards, precision: str, dp_size: int, layer_prefixes=()) -> int:
    """Transient bytes of FSDP2's gathers and reductions, the `buffers` figure of a ZeRO-3 rank (an
    estimate; the peak outside a pipeline counts them per backward instant instead: fsdp_peak.py), with N_u a
    unit's padded unsharded elements and w the compute dtype's size. The root stays gathered from its
    forward to the end of backward, and its unsharded gradients (the LM head's first) live until its
    reduction, last: 2 w N_root. On top, during one layer's backward: its gathered weights, the
    previous layer's (FSDP2's implicit backward prefetch), its unsharded gradients (w each) and the
    fp32 reduce-scatter input (4 N_L); or, at the root's reduction, its fp32 reduce-scatter input
    (4 N_root). Forward holds less (the root plus one gathered layer, no prefetch: forward_prefetch=0).
    No layer_prefixes: the whole model is one unit (the root)."""
    w = BYTES[precision]
    units = fsdp_units(shards, layer_prefixes)
    sizes = [sum(fsdp_padded_numel(s, dp_size) * dp_size for s in u) for u in units]
    root, layers = sizes[0], sizes[1:]
    root_held = 2 * w * root                                    # gathered weights + unsharded grads
    layer_peak = max(((3 * w + REDUCE_BYTES) * n for n in layers), default=0)   # 2 gathered + grads + RS input
    return root_held + max(layer_peak, REDUCE_BYTES * root)


def fsdp_comm_bytes(shards, precision: str, dp_size: int, layer_prefixes=(),
                    reshard_after_forward: bool = True) -> list[tuple[str, int]]:
    """(op, payload bytes) of FSDP2's dp collectives in one optimizer step (one forward and backward), in
    execution order, in comm_counter's units (the full tensor: the all-gather's output, the
    reduce-scatter's input; both padded to dp x ceil(d0/dp) rows): each unit all-gathered in the
    compute dtype in forward and, resharded after it (every unit but the root), again in backward;
    each unit reduce-scattered once, in fp32. Only `dispatched_comm_counter` sees these: FSDP2 calls
    torch.distributed itself, not meshboost's `comm` wrappers, so `comm_counter` records none of them."""
    if dp_size == 1:
        return []
    w = BYTES[precision]
    units = fsdp_units(shards, layer_prefixes)
    sizes = [sum(fsdp_padded_numel(s, dp_size) * dp_size for s in u) for u in units]
    out = [("all_gather", w * n) for n in sizes]                   # forward: root, then the layers
    for i in range(len(sizes) - 1, 0, -1):                         # backward: the layers, last first
        if reshard_after_forward:
            out.append(("all_gather", w * sizes[i]))
        out.append(("reduce_scatter", REDUCE_BYTES * sizes[i]))
    out.append(("reduce_scatter", REDUCE_BYTES * sizes[0]))        # the root, at the end of backward
    return [(op, n) for op, n in out if n]


def hsdp_replica_bytes(shards, dp_shard: int) -> int:
    """Payload bytes of HSDP's all-reduce over the replicas in one step: each unit's reduced fp32 shard
    (its padded rows / dp_shard), once (FSDP2's HSDP all-reduces after the reduce-scatter)."""
    return REDUCE_BYTES * sum(fsdp_padded_numel(s, dp_shard) for s in shards)


def fsdp_rank_state(layout, shards, dp_rank: int) -> dict:
    """`fsdp_state_bytes` of one rank of a ZeRO-3 `layout`, each of its `fsdp_groups` over its own group."""
    if getattr(shards, "frozen", None):     # FSDP2 shards frozen weights too (fp32 shards, gathered per unit)
        raise NotImplementedError("frozen parameters (LoRA's base) under zero=3 are not modelled yet by the planner")
    parts = [fsdp_state_bytes(g, layout.precision, n, i) for g, n, i in fsdp_groups(layout, shards, dp_rank)]
    return {k: sum(p[k] for p in parts) for k in ("weights", "gradients", "masters", "optimizer_states")}


def fsdp_rank_buffers(layout, shards, dp_rank: int, layer_prefixes) -> int:
    """`fsdp_buffer_bytes` (at the dense shard group's size) + each group's `fsdp_padding_bytes`."""
    return (fsdp_buffer_bytes(shards, layout.precision, layout.fsdp_sizes[1], layer_prefixes)
            + sum(fsdp_padding_bytes(g, n, i) for g, n, i in fsdp_groups(layout, shards, dp_rank)))


def fsdp_step_comm(layout, shards, layer_prefixes) -> dict[str, list[tuple[str, int]]]:
    """{axis: [(op, payload bytes)]} of FSDP2 in one step of a ZeRO-3 `layout`, per op: each group's
    all-gathers and reduce-scatters over its shard axis (dense: dp, experts: edp), a pipeline stage's
    gathered once per step (the plugin's reshard_after_forward default is False under pp), and HSDP's
    all-reduce of every group's reduced shards (dense and experts) over dp_replicate."""
    out: dict[str, list[tuple[str, int]]] = {}
    for group, size, _ in fsdp_groups(layout, shards, 0):
        ops = fsdp_comm_bytes(group, layout.precision, size, layer_prefixes, reshard_after_forward=layout.pp == 1)
        totals = [(op, sum(n for o, n in ops if o == op)) for op in ("all_gather", "reduce_scatter")]
        out.setdefault("edp" if group[0].expert else "dp", []).extend((op, n) for op, n in totals if n)
    if layout.fsdp_sizes[0] > 1:    # experts and dense weights replicate over the same dp_replicate groups
        out["dp_replicate"] = [("all_reduce", sum(hsdp_replica_bytes(g, size) for g, size, _ in
                                                  fsdp_groups(layout, shards, 0)))]
    return out


def offload_split(state: dict, precision: str, zero_stage: int) -> tuple[dict, dict]:
    """ZeRO-1/2 with cpu_offload: (device bytes, host bytes) from `memory.state_bytes`'s dict for the same
    rank. ZeroOptimizer then allocates every bucket's master shard (padding included; a copy even in
    fp32, where it would otherwise be the weights' own slice) on the host, so AdamW's moments are there
    too; weights and the gradients after backward stay on the device (the reduced shard goes down only
    at step). Host: {masters, optimizer_states, staging}: staging is HostStaging's one working-dtype
    buffer per bucket, allocated at the first step and kept. `memory_breakdown` counts tensors wherever
    they live: its fp32_masters and optimizer_states are the host ones here."""
    if zero_stage not in (1, 2):
        raise ValueError(f"cpu_offload needs zero_stage 1 or 2, got {zero_stage}")
    owned = state["optimizer_states"] // (ADAM_STATES * 4)        # this rank's shard elements, padding included
    device = {"weights": state["weights"], "gradients": state["gradients"], "masters": 0, "optimizer_states": 0}
    host = {"masters": 4 * owned, "optimizer_states": state["optimizer_states"], "staging": BYTES[precision] * owned}
    return device, host
