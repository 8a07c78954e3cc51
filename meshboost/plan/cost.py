"""Communication bytes per step per axis and a simple step-time model for ranking layouts.

Owns: the collectives meshboost issues per optimizer step for a layout, per rank, in
`comm_counter`'s payload units (bytes of the logical tensor each collective works on):
    tp: per micro-batch, 4 all-reduces of [b, s, hidden] per layer held (Megatron's f and g of the
        attention and MLP blocks), 1 for the vocab-parallel embedding (first stage), 1 for the LM
        head's input gradient and, for a causal LM, the vocab-parallel loss's 3 x 4 x b x s bytes
        (last stage), and the input check's all-gather of 6 int64 per rank per forward call; with
        checkpointing +1 per layer: torch's non-reentrant checkpoint stops recomputing once it has
        every saved tensor, so of a pre-norm layer's two forward all-reduces only the attention's runs
        again (measured on Llama; a post-norm layer, BERT's, re-runs both: not modelled);
    pp: per micro-batch, the boundary activation forward (with its 648-byte header) and its gradient
        backward ([b, s, hidden]),
        the all-reduce of weights tied across stages (their own stage group), the input check;
    dp: zero 0, one all-reduce of the gradients; ZeRO-1/2 a reduce-scatter of the padded buckets and
        an all-gather of the updated shards (working dtype);
and the step time of the busiest stage (`step_seconds`, the ranking's figure), nothing overlapped:
    M micro-batch slots + (pp - 1) bubble slots (1F1B: the bubble is (pp - 1) / (M + pp - 1) of the
        slots; a bubble slot runs at `solo_speedup` x the speed, the other stages being idle), each
        slot = compute (6 flops per parameter per token, 8 with checkpointing, plus attention
        4 x b x s^2 x hidden per layer forward, x3 with backward, / tp) at `flops` per second
        + the fixed cost per layer (`layer_overhead_s`, x 4/3 with checkpointing' recompute) and per
        micro-batch (`microbatch_overhead_s` on a stage with the embedding or head,
        `pipeline_overhead_s` under a pipeline) + its tp collectives;
    + every collective: calls x latency (`<op>_latency_s`, + `inter_node_latency_s` across nodes) + the
        ring bytes (all-reduce 2(P-1)/P n, reduce-scatter and all-gather (P-1)/P n, send n) at its
        op's bus bandwidth inside a node, or `inter_node_bytes_s` (from the mesh order (dp, pp, tp), tp
        innermost); calls: tp one per all-reduced activation, pp two per micro-batch, dp one per DDP
        bucket (25 MiB) or ZeRO bucket, one under a pipeline;
    + the optimizer step: the rank's fp32 master elements (ZeRO: its 1/dp share) at
        `optimizer_elements_s`.
Its constants are `CostConstants`: defaults for an 80 GB H100-class GPU, a known GPU's by name, or
measured on this machine (calibrate.py); `source` says which. Must not estimate memory.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


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
    all_reduce_latency_s: float = 15e-6
    reduce_scatter_latency_s: float = 15e-6
    all_gather_latency_s: float = 15e-6
    send_latency_s: float = 10e-6
    inter_node_latency_s: float = 25e-6    # added per call of a group that spans nodes
    layer_overhead_s: float = 150e-6       # fixed cost per layer per micro-batch (forward + backward)
    microbatch_overhead_s: float = 100e-6  # fixed cost per micro-batch (embedding, head, loss, schedule)
    optimizer_elements_s: float = 50e9     # AdamW elements (fp32 masters) updated per second
    solo_speedup: float = 1.0              # compute speed-up of a rank while the others idle (shared cores)
    pipeline_overhead_s: float = 50e-6     # the 1F1B schedule's own cost per micro-batch slot
    source: str = "defaults (H100 SXM-class: 989 TFLOPS bf16 x 0.4; NVLink; not calibrated)"

    def flops(self, precision: str) -> float:
        return self.flops_fp32 if precision == "fp32" else self.flops_half

    def bandwidth(self, op: str) -> float:
        """Bus bytes/s of `op` inside a node."""
        return getattr(self, f"{op}_bytes_s")

    def latency(self, op: str) -> float:
        return getattr(self, f"{op}_latency_s")


def ring_factor(op: str, size: int) -> float:
    if size <= 1:
        return 0.0
    return {"all_reduce": 2 * (size - 1) / size, "reduce_scatter": (size - 1) / size,
            "all_gather": (size - 1) / size, "send": 1.0}[op]


INPUT_CHECK_BYTES = 48     # check_inputs="always": 6 int64 per rank all-gathered per forward call
P2P_HEADER_BYTES = 8 * (1 + 8 * (2 + 8))    # p2p.py's header before each activation send (int64)


def comm_per_step(layout, hidden: int, layers_held: int, first: bool, last: bool, local_numel: int,
                  padded_numel: int, seq: int, tied_numel: int = 0,
                  vocab_parallel_loss: bool = False, lm_head: bool = True) -> dict[str, list[tuple[str, int]]]:
    """{axis: [(op, payload bytes), ...]} one rank of `layout` issues in one optimizer step.
    vocab_parallel_loss: the last stage's causal-LM loss runs on vocab-split logits (two fp32
    all-reduces over tp per micro-batch: the row max [N] and the two sums [2, N]); lm_head: the model
    ends in a vocab-parallel LM head (whose input gradient is all-reduced over tp)."""
    w = BYTES[layout.precision]
    tokens = layout.microbatch_size * seq
    act = tokens * hidden * w
    m = layout.microbatches
    out: dict[str, list[tuple[str, int]]] = {"tp": [], "pp": [], "dp": []}
    if layout.tp > 1:
        per_microbatch = 4 * layers_held + (1 if first else 0) + (1 if last and lm_head else 0)
        if layout.checkpointing:      # the recomputed forward's attention all-reduce (see the docstring)
            per_microbatch += layers_held
        out["tp"].append(("all_reduce", per_microbatch * m * act))
        if vocab_parallel_loss and last:
            out["tp"].append(("all_reduce", 3 * 4 * tokens * m))
    if layout.tp * layout.pp > 1:         # the input check: per forward call, one per pipeline step
        calls = 1 if layout.pp > 1 else m
        out["tp" if layout.pp == 1 else "pp"].append(("all_gather", calls * INPUT_CHECK_BYTES * layout.tp * layout.pp))
    if layout.pp > 1:
        forward = 0 if last else m * (act + P2P_HEADER_BYTES)
        backward = 0 if first else m * act
        out["pp"].append(("send", forward + backward))
        if tied_numel:
            out["pp"].append(("all_reduce", tied_numel * w))
    if layout.zero == 0 and layout.dp > 1:
        out["dp"].append(("all_reduce", local_numel * w))
    elif layout.zero in (1, 2) and layout.dp > 1:
        out["dp"].append(("reduce_scatter", padded_numel * w))
        out["dp"].append(("all_gather", padded_numel * w))
    return out


def axis_bandwidth(layout, axis: str, gpus_per_node: int, constants: CostConstants, op: str = "all_reduce") -> float:
    """Bytes/s of `axis`: inside a node when the group's ranks all are (mesh order (dp, pp, tp))."""
    return constants.bandwidth(op) if _inside(layout, axis, gpus_per_node) else constants.inter_node_bytes_s


def _inside(layout, axis: str, gpus_per_node: int) -> bool:
    span = {"tp": layout.tp, "pp": layout.tp * layout.pp, "dp": layout.tp * layout.pp * layout.dp}[axis]
    return span <= gpus_per_node


DDP_BUCKET_BYTES = 25 * 2 ** 20     # torch DDP's default bucket_cap_mb


def calls_per_step(layout, axis: str, op: str, nbytes: int, hidden: int, seq: int, zero_buckets: int = 1) -> int:
    """How many calls `comm_per_step`'s (axis, op, nbytes) entry stands for (each pays a latency)."""
    if not nbytes:
        return 0
    m = layout.microbatches
    if axis == "tp" and op == "all_reduce":
        act = layout.microbatch_size * seq * hidden * BYTES[layout.precision]
        return max(1, round(nbytes / act)) if nbytes >= act else 2 * m     # activations, else the loss's two
    if op == "all_gather" and axis in ("tp", "pp") and nbytes < 2 ** 16:
        return 1 if layout.pp > 1 else m                                 # the input check
    if axis == "pp" and op == "send":
        return 2 * m
    if axis == "dp" and op == "all_reduce":
        return 1 if layout.pp > 1 else max(1, -(-nbytes // DDP_BUCKET_BYTES))
    if axis == "dp":
        return zero_buckets
    return 1


def step_seconds(layout, stage_numel: int, layers_held: int, hidden: int, seq: int,
                 comm: dict[str, list[tuple[str, int]]], gpus_per_node: int, constants: CostConstants,
                 ends: bool = True, zero_buckets: int = 1, breakdown: dict | None = None) -> float:
    """Predicted seconds of one optimizer step of the busiest stage (the ranking's figure):
    (M + pp - 1) micro-batch slots (1F1B: the bubble is (pp - 1) / (M + pp - 1) of the step), each
    the stage's compute (flops at `flops` per second, plus the fixed cost per layer and per
    micro-batch), plus every collective (latency per call + ring bytes at its axis's bandwidth, the
    tp ones inside each slot), plus the optimizer step over the rank's fp32 masters (ZeRO: its
    shard), nothing overlapped. `ends`: the stage holds the embedding or the head (the per-micro-batch
    overhead). `breakdown`, when given, receives the terms."""
    tokens = layout.microbatch_size * seq
    per_param = 8 if layout.checkpointing else 6
    attention = (4 if layout.checkpointing else 3) * 4 * layout.microbatch_size * seq * seq * hidden * layers_held
    flops = per_param * stage_numel * tokens + attention / layout.tp
    recompute = 4 / 3 if layout.checkpointing else 1.0
    overhead = (layers_held * constants.layer_overhead_s * recompute + (constants.microbatch_overhead_s if ends else 0)
                + (constants.pipeline_overhead_s if layout.pp > 1 else 0))
    sizes = {"tp": layout.tp, "pp": 2, "dp": layout.dp}
    wire = {"tp": 0.0, "pp": 0.0, "dp": 0.0}
    for axis, ops in comm.items():
        inside = _inside(layout, axis, gpus_per_node)
        for op, n in ops:
            if sizes[axis] <= 1 or not n:
                continue
            calls = calls_per_step(layout, axis, op, n, hidden, seq, zero_buckets)
            latency = constants.latency(op) + (0 if inside else constants.inter_node_latency_s)
            wire[axis] += calls * latency + n * ring_factor(op, sizes[axis]) / axis_bandwidth(
                layout, axis, gpus_per_node, constants, op)
    m, slots = layout.microbatches, layout.microbatches + layout.pp - 1
    microbatch_s = flops / constants.flops(layout.precision) + overhead + wire["tp"] / m
    masters = stage_numel / (layout.dp if layout.zero else 1)
    optimizer = masters / constants.optimizer_elements_s
    # the bubble's pp - 1 slots run while other stages idle: at solo speed where ranks share cores
    bubble_s = (layout.pp - 1) * microbatch_s / constants.solo_speedup
    total = m * microbatch_s + bubble_s + wire["pp"] + wire["dp"] + optimizer
    if breakdown is not None:
        breakdown.update(compute=slots * flops / constants.flops(layout.precision), overhead=slots * overhead,
                         tp=slots * wire["tp"] / m, pp=wire["pp"], dp=wire["dp"], optimizer=optimizer,
                         bubble=(layout.pp - 1) / slots)
    return total
