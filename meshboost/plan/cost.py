"""Communication bytes per step per axis and a simple step-time model for ranking layouts.

Owns: the collectives meshboost issues per optimizer step for a layout, per rank, in
`comm_counter`'s payload units (bytes of the logical tensor each collective works on):
    tp: per micro-batch, 4 all-reduces of [b, s, hidden] per layer held (Megatron's f and g of the
        attention and MLP blocks), 1 for the vocab-parallel embedding (first stage), 1 for the LM
        head's input gradient and, for a causal LM, the vocab-parallel loss's 3 x 4 x b x s bytes
        (last stage), the input check's all-gather of 6 float64 per rank per forward call, the
        gradients summed over tp (whole q/k norms, replicated key/value head shards) and, for an MoE,
        f on the routing weights (ep = 1) or f and g on the rows received (ep > 1); with
        checkpointing +1 per layer: torch's non-reentrant checkpoint stops recomputing once it has
        every saved tensor, so of a pre-norm layer's two forward all-reduces only the attention's runs
        again (measured on Llama), +2 for a post-norm layer (BERT's; measured);
    ep: the all-to-alls of expert parallelism (`ep_per_step`); edp: the expert weights' reduction;
    pp: per micro-batch, the boundary activation forward (with its 648-byte header) and its gradient
        backward ([b, s, hidden]),
        the all-reduce of weights tied across stages (their own stage group), the input check;
    dp: the global batch's labelled-token count (a causal LM outside a pipeline), zero 0, one
        all-reduce of the (dense) gradients; ZeRO-1/2 a reduce-scatter of the padded buckets and
        an all-gather of the updated shards (working dtype);
and the step time of the busiest stage (`step_seconds`, the ranking's figure), nothing overlapped:
    M micro-batch slots + (pp - 1) bubble slots (1F1B: the bubble is (pp - 1) / (M + pp - 1) of the
        slots; a bubble slot runs at `solo_speedup` x the speed, the other stages being idle), each
        slot = compute (6 flops per parameter per token, 8 with full checkpointing, plus attention
        4 x b x s^2 x hidden per layer forward, x3 with backward, x4 full, / tp) at `flops` per second
        + the fixed cost per layer (`layer_overhead_s`, x 4/3 with either recompute's kernels) and per
        micro-batch (`microbatch_overhead_s` on a stage with the embedding or head,
        `pipeline_overhead_s` under a pipeline) + its tp collectives;
    + every collective: calls x latency (`<op>_latency_s`, + `inter_node_latency_s` across nodes) + the
        ring bytes (all-reduce 2(P-1)/P n, reduce-scatter and all-gather (P-1)/P n, send n) at its
        op's bus bandwidth inside a node, or `inter_node_bytes_s` when a group of the axis spans nodes
        (the runtime mesh's groups, read from `ParallelDims.mesh_axes` by `layout.axis_groups`; P its
        group size); calls: tp one per all-reduced activation, pp two per micro-batch, dp one per DDP
        bucket (25 MiB) or ZeRO bucket, one under a pipeline; HSDP's dp_replicate one per FSDP2 unit;
    + the optimizer step: the rank's fp32 master elements (ZeRO: its 1/dp share) at
        `optimizer_elements_s`;
    + ZeRO-1/2's new buffers per step (`zero_fresh_bytes`: the flattened gradients, the reduce-scatter's
        shard, with fp32 masters their fp32 gradient, the working shard and the gathered bucket) at
        `fresh_bytes_s`.
Its constants are `CostConstants`: defaults for an 80 GB H100-class GPU, a known GPU's by name, or
measured on this machine (calibrate.py); `source` says which. Must not estimate memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshboost.distributed.agreement import INPUT_DIGEST_BYTES
from meshboost.distributed.p2p import ACTIVATION_HEADER_BYTES
from meshboost.optim.precision import PRECISION_BYTES as BYTES
from meshboost.pipeline.schedule import LOSS_BROADCAST_BYTES
from meshboost.plan.layout import axis_inside_node, axis_size
from meshboost.plugins.config import DDP_BUCKET_CAP_MB
from meshboost.plugins.input_checks import EMPTY_FLAG_BYTES, PIPELINE_AGREEMENT_BYTES


@dataclass(frozen=True)
class CostConstants:
    """Rates the step-time model uses. Defaults: H100 SXM-class (datasheet peak x efficiency, see
    calibrate.py), NVLink inside a node, 200 Gb/s InfiniBand across nodes; `calibrate.calibrate()`
    measures them on this machine (`python -m meshboost.plan --calibrate`). `source` says which."""

    flops_half: float = 400e12       # achieved dense bf16/fp16 flop/s (about 40% of peak)
    flops_fp32: float = 50e12        # achieved fp32 (TF32 off) flop/s
    intra_node_bytes_s: float = 200e9      # NVLink, per direction, per GPU (bus bandwidth)
    inter_node_bytes_s: float = 25e9       # 200 Gb/s per GPU across nodes
    # per-op bus bandwidth inside a node (bytes/s) and latency per call (seconds)
    all_reduce_bytes_s: float = 200e9
    reduce_scatter_bytes_s: float = 200e9
    all_gather_bytes_s: float = 200e9
    send_bytes_s: float = 200e9
    broadcast_bytes_s: float | None = None     # None: all_gather's
    broadcast_latency_s: float | None = None
    all_reduce_latency_s: float = 15e-6
    reduce_scatter_latency_s: float = 15e-6
    all_gather_latency_s: float = 15e-6
    send_latency_s: float = 10e-6
    all_to_all_bytes_s: float | None = None    # None: all_gather's (same ring volume per rank)
    all_to_all_latency_s: float | None = None
    inter_node_latency_s: float = 25e-6    # added per call of a group that spans nodes
    layer_overhead_s: float = 150e-6       # fixed cost per layer per micro-batch (forward + backward)
    microbatch_overhead_s: float = 100e-6  # fixed cost per micro-batch (embedding, head, loss, schedule)
    optimizer_elements_s: float = 50e9     # AdamW elements (fp32 masters) updated per second
    solo_speedup: float = 1.0              # compute speed-up of a rank while the others idle (shared cores)
    pipeline_overhead_s: float = 50e-6     # the 1F1B schedule's own cost per micro-batch slot
    # bytes/s written into newly allocated memory (a clone): on a CPU every first touch of a page faults (glibc returns
    # large blocks to the OS); a GPU's caching allocator reuses its blocks: about HBM bandwidth (3.35 TB/s r+w, x 0.6)
    fresh_bytes_s: float = 1.0e12
    host_bytes_s: float = 40e9             # pinned host -> device copies: PCIe Gen5 x16, 64 GB/s per direction x 0.6
    source: str = "defaults (H100 SXM-class: 989 TFLOPS bf16 x 0.4; NVLink; not calibrated)"

    def flops(self, precision: str) -> float:
        return self.flops_fp32 if precision == "fp32" else self.flops_half

    def bandwidth(self, op: str) -> float:
        """Bus bytes/s of `op` inside a node."""
        value = getattr(self, f"{op}_bytes_s")
        return self.all_gather_bytes_s if value is None else value

    def latency(self, op: str) -> float:
        value = getattr(self, f"{op}_latency_s")
        return self.all_gather_latency_s if value is None else value


def ring_factor(op: str, size: int) -> float:
    if size <= 1:
        return 0.0
    return {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
            "all_gather": (size - 1) / size, "all_to_all": (size - 1) / size, "send": 1.0,
            "broadcast": 1.0}[op]


# the runtime's own figures (tests/plan/test_runtime_facts.py measures them on the real sends):
INPUT_CHECK_BYTES = INPUT_DIGEST_BYTES      # check_inputs="always": per rank all-gathered per forward call (tp, pp, cp)
P2P_HEADER_BYTES = ACTIVATION_HEADER_BYTES  # p2p.py's header before each activation send
DDP_BUCKET_BYTES = DDP_BUCKET_CAP_MB * 2 ** 20  # the bucket_cap_mb meshboost passes DDP (torch: MiB)


@dataclass(frozen=True)
class MoeTraffic:
    """What an MoE moves for one rank: `layers` MoE layers held, `top_k` experts per token, `experts`
    per layer; `local_numel` / `padded_numel`: the rank's expert-weight elements (and
    padded to ZeRO's edp multiple), reduced over the experts' replicas edp = dp / ep."""

    layers: int
    top_k: int
    experts: int
    local_numel: int = 0
    padded_numel: int = 0


@dataclass(frozen=True)
class AttentionShape:
    """Attention heads one tp rank computes: query heads, key/value heads, head_dim."""

    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class SequenceTraffic:
    """What splitting the sequence adds: the attention's shape per tp rank (context parallelism's
    exchanges) and split_gather's replicated elements per layer fed the chunk (gradients summed over tp)."""

    attention: AttentionShape
    summed_per_layer: int = 0


def cp_per_step(layout, attention: AttentionShape, layers_held: int, tokens: int, last: bool) -> list[tuple[str, int]]:
    """Context parallelism's traffic over the cp group per step (`shardformer/context.py`), per layer and
    micro-batch, with `tokens` this rank's piece: all_to_all, forward 4 all-to-alls (q, k, v whole
    sequence to heads, the output back; each payload this rank's [tokens, heads, head_dim], key/value
    heads repeated to the query heads when they do not divide by cp) and backward their 4 reverses;
    ring_attn, forward an all-gather of k and of v (payload the gathered [cp x tokens, kv heads,
    head_dim]) and backward their reduce-scatters; checkpointing runs the forward exchanges again. On
    the last stage, the loss averaged over cp (an fp32 scalar per micro-batch)."""
    w = BYTES[layout.precision]
    forwards = 2 if layout.checkpointing else 1
    q = tokens * attention.heads * attention.head_dim * w
    kv_heads = attention.kv_heads if attention.kv_heads % layout.cp == 0 else attention.heads
    kv = tokens * kv_heads * attention.head_dim * w
    m = layout.microbatches
    out = []
    if layout.cp_mode == "ring_attn":
        gathered = 2 * layout.cp * tokens * attention.kv_heads * attention.head_dim * w
        out.append(("all_gather", forwards * gathered * layers_held * m))
        out.append(("reduce_scatter", gathered * layers_held * m))
    else:
        out.append(("all_to_all", (forwards + 1) * (2 * q + 2 * kv) * layers_held * m))
    if last:
        out.append(("all_reduce", 4 * m))
    return out


def ep_per_step(layout, moe: MoeTraffic, tokens: int, hidden: int) -> list[tuple[str, int]]:
    """Expert parallelism's all-to-alls per step (`ExpertParallelForward`): per MoE layer and
    micro-batch, forward a header of ep x (E / ep + 1) int64 counts, the dispatch of the tokens x top_k
    rows sent and the return of the rows received; backward the same two exchanges reversed (each
    payload the forward output's size). Rows received depend on the routing: their mean over the ep
    group is tokens x top_k, the figure predicted; checkpointing runs the forward exchanges again."""
    if layout.ep == 1 or not moe.layers:
        return []
    w = BYTES[layout.precision]
    rows = tokens * moe.top_k * hidden * w
    forwards = 2 if layout.checkpointing else 1
    header = 8 * layout.ep * (moe.experts // layout.ep + 1)
    per_layer = forwards * (header + 2 * rows) + 2 * rows
    return [("all_to_all", per_layer * moe.layers * layout.microbatches)]


def tp_per_step(layout, moe: MoeTraffic | None, tokens: int, act: int, layers_held: int, first: bool, last: bool,
                lm_head: bool, post_norm: bool, sequence: SequenceTraffic | None, tp_grad_sum: int,
                vocab_parallel_loss: bool, frozen_inputs: int = 0) -> list[tuple[str, int]]:
    """Tensor parallelism's collectives per step (comm_per_step's arguments; act: one micro-batch's
    [tokens, hidden] activation in bytes): Megatron's f and g per layer, the stack's ends, the recompute's
    under checkpointing, split_gather's all-gathers and reduce-scatters in their place, the experts' and
    the vocab-parallel loss's; less the backward ones of `frozen_inputs` blocks whose input needs no gradient
    (plan/lora.py) and, then, the stack entry's gathered gradient under split_gather."""
    w = BYTES[layout.precision]
    m = layout.microbatches
    out: list[tuple[str, int]] = []
    per_microbatch = 4 * layers_held + (1 if first else 0) + (1 if last and lm_head else 0) - frozen_inputs
    if layout.checkpointing:      # the recomputed forward's all-reduces (see the docstring)
        per_microbatch += (2 if post_norm else 1) * layers_held
    moe_layers = moe.layers if moe is not None else 0
    if moe_layers and layout.ep > 1:      # the experts' f and g on the rows received (mean: tokens x top_k)
        per_microbatch += 2 * (moe.top_k - 1) * moe_layers
    if sequence is not None and layout.sequence_parallel:
        # split_gather: each layer all-reduce becomes an all-gather and a reduce-scatter of the same
        # [b, s, h] (payload: the whole tensor each); the stack's entry gathers the gradient
        # backward and its exit the output forward; the recompute re-runs its gathers (see docstring)
        layer_ops = 4 * layers_held + (1 if first and not frozen_inputs else 0) + (1 if last else 0)
        recomputed = (2 * layers_held, layers_held) if layout.checkpointing else (0, 0)
        out.append(("all_gather", (layer_ops + recomputed[0]) * m * act))
        out.append(("reduce_scatter", (4 * layers_held - frozen_inputs + recomputed[1]) * m * act))
        ends = (1 if first else 0) + (1 if last and lm_head else 0)
        out.append(("all_reduce", ends * m * act))
        if sequence.summed_per_layer:
            out.append(("all_reduce", m * layers_held * sequence.summed_per_layer * w))
    else:
        out.append(("all_reduce", per_microbatch * m * act))
    if moe_layers and layout.ep == 1:     # f on the routing weights [tokens, top_k]
        out.append(("all_reduce", moe_layers * m * tokens * moe.top_k * w))
    if tp_grad_sum:
        out.append(("all_reduce", m * tp_grad_sum * w))
    if vocab_parallel_loss and last:
        out.append(("all_reduce", 3 * 4 * tokens * m))
    return out


def comm_per_step(layout, hidden: int, layers_held: int, first: bool, last: bool, local_numel: int,
                  padded_numel: int, seq: int, tied_numel: int = 0,
                  vocab_parallel_loss: bool = False, lm_head: bool = True,
                  moe: MoeTraffic | None = None, tp_grad_sum: int = 0,
                  post_norm: bool = False, sequence: SequenceTraffic | None = None,
                  frozen_inputs: int = 0) -> dict[str, list[tuple[str, int]]]:
    """{axis: [(op, payload bytes), ...]} one rank of `layout` issues in one optimizer step.
    vocab_parallel_loss: a causal LM, whose last stage's loss runs on vocab-split logits (two fp32
    all-reduces over tp per micro-batch: the row max [N] and the two sums [2, N]) and, outside a
    pipeline, whose labelled tokens are counted over dp per forward call; lm_head: the model
    ends in a vocab-parallel LM head (whose input gradient is all-reduced over tp). local_numel and
    padded_numel are the dense weights'; `moe` the experts' (axes ep and edp); tp_grad_sum: gradient
    elements summed over tp each backward (whole q/k norms, replicated key/value head shards);
    post_norm: the layers end in a norm (BERT's), so checkpointing's recompute runs both all-reduces.
    sequence: the layout splits the sequence (split_gather over tp, or context parallelism over cp).
    frozen_inputs: blocks whose input gradient is never computed (LoRA's frozen embedding: plan/lora.py)."""
    w = BYTES[layout.precision]
    tokens = layout.microbatch_size * seq // layout.cp         # this rank's piece under context parallelism
    act = tokens * hidden * w
    m = layout.microbatches
    out: dict[str, list[tuple[str, int]]] = {"tp": [], "pp": [], "dp": [], "ep": [], "edp": [], "cp": []}
    if layout.cp > 1:
        out["cp"] = cp_per_step(layout, sequence.attention, layers_held, tokens, last)
    if moe is not None:
        out["ep"] = ep_per_step(layout, moe, tokens, hidden)
        edp = axis_size(layout.dims, "edp")             # the experts' replicas (x cp: they see pieces too)
        if layout.ep > 1 and edp > 1 and moe.local_numel and layout.zero != 3:    # ZeRO-3: sharded.fsdp_step_comm
            if layout.zero == 0:
                out["edp"].append(("all_reduce", moe.local_numel * w))
            else:
                out["edp"].append(("reduce_scatter", moe.padded_numel * w))
                out["edp"].append(("all_gather", moe.padded_numel * w))
    if layout.tp > 1:
        out["tp"] = tp_per_step(layout, moe, tokens, act, layers_held, first, last, lm_head, post_norm, sequence,
                                tp_grad_sum, vocab_parallel_loss, frozen_inputs)
    # the input check: per forward call (one per pipeline step), an all-gather over tp, pp and cp each
    calls = 1 if layout.pp > 1 else m
    for axis in ("tp", "pp", "cp"):
        if getattr(layout, axis) > 1:
            out[axis].append(("all_gather", calls * INPUT_CHECK_BYTES * getattr(layout, axis)))
    if layout.ep > 1 and layout.pp == 1 and layout.dp > 1:
        # refuse_empty_batch: one int32 per dp rank, all-gathered over dp per forward call (the counter
        # files dp's group under ep when the two hold the same ranks)
        out["ep" if layout.dp == layout.ep else "dp"].append(("all_gather", m * EMPTY_FLAG_BYTES * layout.dp))
    if layout.pp > 1:
        # interleaved: every chunk sends on, but the last rank's last chunk (forward) and the first
        # rank's first chunk (backward)
        v = layout.num_model_chunks
        boundary = act // layout.tp if layout.sequence_parallel else act     # split_gather sends the chunk
        forward = (v - (1 if last else 0)) * m * (boundary + P2P_HEADER_BYTES)
        backward = (v - (1 if first else 0)) * m * boundary
        out["pp"].append(("send", forward + backward))
        # next_pipeline_batch's agreement over the world: once per step (the world group's label)
        out["pp"].append(("all_reduce", PIPELINE_AGREEMENT_BYTES))
        out["pp"].append(("broadcast", LOSS_BROADCAST_BYTES))   # the step's loss, from the last stage to all
        if tied_numel:
            out["pp"].append(("all_reduce", tied_numel * w))
    if vocab_parallel_loss and layout.pp == 1 and layout.dp > 1:
        # the global batch's labelled tokens (loss_normalization "tokens"): one fp32 scalar per forward call
        out["dp"].append(("all_reduce", 4 * m))
    # the gradients are averaged over dp x cp (every weight is replicated over the context ranks)
    if layout.zero == 0 and layout.grad_replicas > 1:
        out["dp"].append(("all_reduce", local_numel * w))
    elif layout.zero in (1, 2) and layout.grad_replicas > 1:
        out["dp"].append(("reduce_scatter", padded_numel * w))
        out["dp"].append(("all_gather", padded_numel * w))
    return out


def axis_bandwidth(layout, axis: str, gpus_per_node: int, constants: CostConstants, op: str = "all_reduce") -> float:
    """Bytes/s of `axis`: inside a node when every group of it is (the runtime mesh's groups,
    `layout.axis_groups`, from `ParallelDims.mesh_axes`)."""
    return constants.bandwidth(op) if _inside(layout, axis, gpus_per_node) else constants.inter_node_bytes_s


def _inside(layout, axis: str, gpus_per_node: int) -> bool:
    return axis_inside_node(layout.dims, axis, gpus_per_node)


def calls_per_step(layout, axis: str, op: str, nbytes: int, hidden: int, seq: int, zero_buckets: int = 1,
                   layers_held: int = 1) -> int:
    """How many calls `comm_per_step`'s (axis, op, nbytes) entry stands for (each pays a latency)."""
    if not nbytes:
        return 0
    m = layout.microbatches
    if op == "all_gather" and axis in ("tp", "pp", "cp") and nbytes < 2 ** 16:
        return 1 if layout.pp > 1 else m                                 # the input check
    if axis == "tp" and op in ("all_reduce", "all_gather", "reduce_scatter"):
        act = layout.microbatch_size * seq // layout.cp * hidden * BYTES[layout.precision]
        return max(1, round(nbytes / act)) if nbytes >= act else 2 * m     # activations, else the loss's two
    if axis == "cp":                     # per layer: 4 all-to-alls each way, or 2 gathers / 2 reduce-scatters
        forwards = 2 if layout.checkpointing else 1
        per_layer = {"all_to_all": 4 * (forwards + 1), "all_gather": 2 * forwards, "reduce_scatter": 2}.get(op)
        return per_layer * layers_held * m if per_layer else m
    if axis == "pp" and op == "send":
        return 2 * m
    if axis == "ep":                                                     # 3 forward + 2 backward per layer
        return 5 * m
    if axis == "dp" and op == "all_reduce":
        return 1 if layout.pp > 1 else max(1, -(-nbytes // DDP_BUCKET_BYTES))
    if axis in ("dp", "edp", "dp_replicate"):
        return zero_buckets if layout.zero else 1
    return 1


def zero_fresh_bytes(layout, stage_numel: int) -> int:
    """Bytes ZeRO-1/2 write into newly allocated tensors per step (optim/zero.py): each bucket's
    gradients concatenated into one flat tensor and, over dp > 1, the reduce-scatter's output shard, in
    the working dtype; with fp32 masters (half-precision weights) also the shard's fp32 gradient, the
    updated working shard and, over dp > 1, the all-gathered bucket (fp32 weights are gathered in
    place). 0 without ZeRO-1/2. tests/optim/test_zero_hot_path.py counts them on the runtime."""
    if layout.zero not in (1, 2):
        return 0
    replicas, working = layout.grad_replicas, BYTES[layout.precision]
    shard = stage_numel / replicas
    out = stage_numel * working + (shard * working if replicas > 1 else 0)
    if layout.precision != "fp32":
        out += shard * 4 + shard * working + (stage_numel * working if replicas > 1 else 0)
    return int(out)


def step_seconds(layout, stage_numel: int, layers_held: int, hidden: int, seq: int,
                 comm: dict[str, list[tuple[str, int]]], gpus_per_node: int, constants: CostConstants,
                 ends: bool = True, zero_buckets: int = 1, breakdown: dict | None = None,
                 frozen_numel: int = 0) -> float:
    """Predicted seconds of one optimizer step of the busiest stage (the ranking's figure):
    (M + pp - 1) micro-batch slots (1F1B: the bubble is (pp - 1) / (M + pp - 1) of the step), each
    the stage's compute (flops at `flops` per second, plus the fixed cost per layer and per
    micro-batch), plus every collective (latency per call + ring bytes at its axis's bandwidth, the
    tp ones inside each slot), plus the optimizer step over the rank's fp32 masters (ZeRO: its
    shard), nothing overlapped. `ends`: the stage holds the embedding or the head (the per-micro-batch
    overhead). `breakdown`, when given, receives the terms. `frozen_numel`: frozen weights the stage also
    runs (LoRA's base): forward and the input's gradient, no weight gradient (2 flops per element less)."""
    tokens = layout.microbatch_size * seq // layout.cp        # this rank's piece under context parallelism
    per_param = 8 if layout.recomputes_matmuls else 6        # selective recomputation keeps the matmuls' outputs
    attention = (4 if layout.recomputes_matmuls else 3) * 4 * layout.microbatch_size * seq * seq * hidden * layers_held
    flops = (per_param * stage_numel + (per_param - 2) * frozen_numel) * tokens + attention / (layout.tp * layout.cp)
    recompute = 4 / 3 if layout.checkpointing else 1.0
    overhead = (layers_held * constants.layer_overhead_s * recompute + (constants.microbatch_overhead_s if ends else 0)
                + (constants.pipeline_overhead_s if layout.pp > 1 else 0))
    # ring sizes of each axis's groups (pp's sends are point to point)
    axes = dict.fromkeys(("tp", "pp", "dp", "ep", "edp", "cp", *comm))
    sizes = {axis: 2 if axis == "pp" else axis_size(layout.dims, axis) for axis in axes}
    wire = {axis: 0.0 for axis in sizes}
    for axis, ops in comm.items():
        inside = _inside(layout, axis, gpus_per_node)
        for op, n in ops:
            if sizes[axis] <= 1 or not n:
                continue
            calls = calls_per_step(layout, axis, op, n, hidden, seq, zero_buckets, layers_held)
            latency = constants.latency(op) + (0 if inside else constants.inter_node_latency_s)
            wire[axis] += calls * latency + n * ring_factor(op, sizes[axis]) / axis_bandwidth(
                layout, axis, gpus_per_node, constants, op)
    m, slots = layout.microbatches, layout.microbatches + layout.pp - 1
    microbatch_s = flops / constants.flops(layout.precision) + overhead + (wire["tp"] + wire["cp"]) / m
    masters = stage_numel / (layout.fsdp_sizes[1] if layout.zero == 3 else layout.grad_replicas if layout.zero else 1)
    optimizer = masters / constants.optimizer_elements_s
    fresh = zero_fresh_bytes(layout, stage_numel) / constants.fresh_bytes_s
    # the bubble's pp - 1 slots run while other stages idle: at solo speed where ranks share cores
    bubble_s = (layout.pp - 1) * microbatch_s / constants.solo_speedup / layout.num_model_chunks
    total = m * microbatch_s + bubble_s + sum(wire[a] for a in wire if a not in ("tp", "cp")) + optimizer + fresh
    if breakdown is not None:
        breakdown.update(compute=slots * flops / constants.flops(layout.precision), overhead=slots * overhead,
                         tp=slots * wire["tp"] / m, cp=slots * wire["cp"] / m, pp=wire["pp"],
                         dp=wire["dp"] + wire["edp"] + wire.get("dp_replicate", 0), ep=wire["ep"],
                         optimizer=optimizer, zero_buffers=fresh,
                         bubble=(layout.pp - 1) / slots)
    return total
