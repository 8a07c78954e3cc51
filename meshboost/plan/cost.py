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
and the step time: compute (6 flops per parameter per token, 8 with checkpointing, plus attention
4 x b x s^2 x hidden per layer forward, x3 with backward) at `flops` per second, the ring cost of
every collective (all-reduce 2(P-1)/P n, reduce-scatter and all-gather (P-1)/P n, send n) at the
bandwidth of its axis (inside a node or across nodes, from the mesh order (dp, pp, tp), tp
innermost), the 1F1B bubble ((pp - 1) extra micro-batch slots), nothing overlapped. Its constants
are `CostConstants` (defaults: an 80 GB H100-class GPU, documented in docs/planner.md). Must not
estimate memory.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class CostConstants:
    """Rates the step-time model uses (defaults: H100 SXM-class, NVLink inside a node, 400 Gb/s
    InfiniBand across nodes; rough, and only their ratios matter for the ranking)."""

    flops_half: float = 400e12       # achieved dense bf16/fp16 flop/s (about 40% of peak)
    flops_fp32: float = 50e12        # achieved fp32 (TF32 off) flop/s
    intra_node_bytes_s: float = 200e9      # NVLink, per direction, per GPU
    inter_node_bytes_s: float = 25e9       # 200 Gb/s per GPU across nodes

    def flops(self, precision: str) -> float:
        return self.flops_fp32 if precision == "fp32" else self.flops_half


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


def axis_bandwidth(layout, axis: str, gpus_per_node: int, constants: CostConstants) -> float:
    """Bytes/s of `axis`: inside a node when the group's ranks all are (mesh order (dp, pp, tp))."""
    span = {"tp": layout.tp, "pp": layout.tp * layout.pp, "dp": layout.tp * layout.pp * layout.dp}[axis]
    return constants.intra_node_bytes_s if span <= gpus_per_node else constants.inter_node_bytes_s


def step_seconds(layout, stage_numel: int, layers_held: int, hidden: int, seq: int,
                 comm: dict[str, list[tuple[str, int]]], gpus_per_node: int, constants: CostConstants) -> float:
    """Predicted seconds of one optimizer step of the busiest stage (the ranking's figure)."""
    tokens = layout.microbatch_size * seq
    per_param = 8 if layout.checkpointing else 6
    attention = (4 if layout.checkpointing else 3) * 4 * layout.microbatch_size * seq * seq * hidden * layers_held
    flops = per_param * stage_numel * tokens + attention / layout.tp
    microbatch_s = flops / constants.flops(layout.precision)
    compute = (layout.microbatches + layout.pp - 1) * microbatch_s
    sizes = {"tp": layout.tp, "pp": 2, "dp": layout.dp}
    wire = sum(n * ring_factor(op, sizes[axis]) / axis_bandwidth(layout, axis, gpus_per_node, constants)
               for axis, ops in comm.items() for op, n in ops)
    return compute + wire
