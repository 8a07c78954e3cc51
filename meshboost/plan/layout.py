"""A candidate parallel layout, the plugin config it stands for, and the enumeration of valid ones.

Owns: `Layout` (one `ParallelDims`, the runtime's own record of the degrees tp, pp, dp, ep, cp (context
parallelism) and dp_replicate (HSDP), cp's mode and tp's (Megatron sequence parallelism, split_gather: no
cp), held once; and the training knobs: the ZeRO stage, precision, micro-batches and their size,
activation checkpointing, cpu offload, model chunks), the ranks of each of the planner's axes as the
runtime's mesh groups them (`axis_groups`, read from `ParallelDims.mesh_axes`, never restated), parsing
`--layout tp=2,pp=2,zero=1,...` (ColossalAI's `sp=`/`sp_mode=` accepted for cp), building the
`HybridParallelConfig` a layout stands for (its record passed through whole, so the plugin's own checks
raise their own messages: nothing is copied here), and enumerating every factorisation of the world (and
ep, for an MoE; cp and its modes, for a causal LM; HSDP's replica groups under ZeRO-3) that the model and
the plugin accept.
Must not estimate memory or time (memory.py, cost.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import lru_cache
from itertools import product

from meshboost.distributed.dims import ParallelDims
from meshboost.distributed.param_info import DENSE, EXPERT
from meshboost.optim.precision import PRECISION_BYTES
from meshboost.shardformer.layers.chunked_loss import check_chunk_tokens
from meshboost.shardformer.selective import CHECKPOINTING, FULL, SELECTIVE, check_checkpointing

PRECISIONS = tuple(PRECISION_BYTES)
SPLIT_GATHER = "split_gather"           # Megatron sequence parallelism over the tp group (cp stays 1)
CONTEXT_MODES = ("all_to_all", "ring_attn")     # context parallelism over a cp axis of its own
DIMS_FIELDS = tuple(f.name for f in fields(ParallelDims))     # the record's fields, as `Layout.of` names them
# the JSON output's keys, in the order the planner has always written them
AS_DICT = ("tp", "pp", "dp", "precision", "ep", "cp", "cp_mode", "sequence_parallel", "zero", "microbatches",
           "microbatch_size", "checkpointing", "cpu_offload", "num_model_chunks", "dp_replicate", "loss_chunk")


@dataclass(frozen=True)
class Layout:
    """One layout the plugin can run: the mesh's record `dims` (tp x pp x dp x cp = the world; ep splits the
    experts over ep of the dp ranks; dp_replicate > 1 is HSDP, ZeRO-3 sharded over the dp / dp_replicate
    ranks of one replica group; cp's mode; Megatron sequence parallelism, the tp axis' mode) and the
    training knobs: the ZeRO stage, precision, micro-batching and the memory switches. The degrees are the
    record's only (the properties below read it; `Layout.of` takes them as keywords and builds it first),
    and the plugin's config gets the same record (`plugin_config`). At cp > 1 the context mode defaults to
    "all_to_all", the plugin's default; split_gather (ColossalAI's `enable_sequence_parallelism=True`
    without sp_size) is no cp: the tp ranks split the sequence."""

    dims: ParallelDims = ParallelDims(dp=1)
    precision: str = "bf16"
    zero: int = 0                   # 0, 1, 2 (meshboost's ZeRO), 3 (torch FSDP2)
    microbatches: int = 1
    microbatch_size: int = 1
    checkpointing: str | None = None    # None, "full" (True) or "selective" (shardformer/selective.py)
    cpu_offload: bool = False
    num_model_chunks: int = 1
    loss_chunk: int | None = None       # ShardConfig(loss_chunk_tokens=N): the logits N tokens at a time

    def __post_init__(self):
        if not isinstance(self.dims, ParallelDims):
            raise TypeError(f"Layout(dims={self.dims!r}): pass a meshboost.distributed.ParallelDims, or the degrees "
                            "as keywords, Layout.of(tp=..., dp=..., ...)")
        if self.dims.dp is None:
            raise ValueError(f"Layout(dims={self.dims!r}): a layout is planned for one world; give its dp (the "
                             "data-parallel size)")
        if isinstance(self.checkpointing, bool):      # the planner's older switch: True is full recomputation
            object.__setattr__(self, "checkpointing", FULL if self.checkpointing else None)
        check_checkpointing(self.checkpointing)
        check_chunk_tokens(self.loss_chunk)
        if self.dims.cp > 1 and self.dims.cp_mode is None:      # the plugin's default mode
            object.__setattr__(self, "dims", replace(self.dims, cp_mode=CONTEXT_MODES[0]))

    @classmethod
    def of(cls, tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, cp: int = 1, cp_mode: str | None = None,
           sequence_parallel: bool = False, dp_replicate: int = 1, **knobs) -> "Layout":
        """The degrees as keywords (the runtime's names, as `--layout` spells them), built into the record
        first (as `HybridParallelConfig.of` does); `knobs`: the training fields."""
        return cls(ParallelDims(dp=dp, pp=pp, tp=tp, ep=ep, cp=cp, dp_replicate=dp_replicate, cp_mode=cp_mode,
                                sequence_parallel=sequence_parallel), **knobs)

    # -- the degrees, read from the record (no copy of them here) -----------------------------------
    tp = property(lambda self: self.dims.tp)
    pp = property(lambda self: self.dims.pp)
    dp = property(lambda self: self.dims.dp)
    ep = property(lambda self: self.dims.ep)
    cp = property(lambda self: self.dims.cp)
    cp_mode = property(lambda self: self.dims.cp_mode)
    sequence_parallel = property(lambda self: self.dims.sequence_parallel)
    dp_replicate = property(lambda self: self.dims.dp_replicate)

    @property
    def recomputes_matmuls(self) -> bool:
        """Full checkpointing runs each block's forward again in the backward (its matmuls' flops); selective
        keeps the matmul and attention outputs and recomputes the cheap ops (shardformer/selective.py). Both
        re-issue the block's collectives (the cost model's traffic under `checkpointing`)."""
        return self.checkpointing == FULL

    @property
    def world(self) -> int:
        return self.dims.world

    @property
    def grad_replicas(self) -> int:
        """The ranks a dense gradient is averaged over and ZeRO partitions over: the size of the mesh's
        gradient axes (dp x cp today: every weight is replicated over the context ranks too)."""
        return self.dims.size(*self.dims.grad_axes(DENSE))

    @property
    def fsdp_sizes(self) -> tuple[int, int]:
        """(replicas, shard ranks) of a dense parameter under ZeRO-3: the mesh's `shard_axes` (HSDP's
        dp_replicate and dp_shard x cp; no replicas without HSDP)."""
        replicate, shard = self.dims.shard_axes(DENSE)
        return self.dims.size(*replicate), self.dims.size(*shard)

    def as_dict(self) -> dict:
        """The fields by name, the degrees among them (the planner's JSON output)."""
        return {name: getattr(self, name) for name in AS_DICT}

    def describe(self) -> str:
        ckpt = {None: "", FULL: ",ckpt", SELECTIVE: f",ckpt={SELECTIVE}"}[self.checkpointing]
        ckpt += (",offload" if self.cpu_offload else "") + (f",loss_chunk={self.loss_chunk}" if self.loss_chunk else "")
        ep = f",ep={self.ep}" if self.ep > 1 else ""
        ep += f",chunks={self.num_model_chunks}" if self.num_model_chunks > 1 else ""
        ep += f",dp_replicate={self.dp_replicate}" if self.dp_replicate > 1 else ""
        ep += f",cp={self.cp}({self.cp_mode})" if self.cp > 1 else ""
        ep += f",{SPLIT_GATHER}" if self.sequence_parallel else ""
        return (f"tp={self.tp},pp={self.pp},dp={self.dp}{ep},zero={self.zero},{self.precision},"
                f"mb={self.microbatches}x{self.microbatch_size}{ckpt}")


def planner_axes(dims: ParallelDims, axis: str) -> tuple[str, ...]:
    """The runtime's axes behind one of the planner's traffic axes: tp, pp; cp (context parallelism);
    ep; edp (an expert's gradient replicas); dp (a dense gradient's reduction, or ZeRO-3's shard ranks:
    HSDP's dp_shard); dp_replicate (HSDP's replicas). Read from the dims' gradient and shard axes."""
    replicate, shard = dims.shard_axes(DENSE)
    named = {"tp": ("tp",), "pp": ("pp",), "cp": ("cp",), "ep": ("ep",), "edp": dims.grad_axes(EXPERT),
             "dp": shard, "dp_replicate": replicate}
    if axis not in named:
        raise ValueError(f"axis={axis!r}; the planner's axes are {sorted(named)}")
    return named[axis]


def axis_size(dims: ParallelDims, axis: str) -> int:
    """Ranks in one group of the planner's `axis` (`planner_axes`)."""
    return dims.size(*planner_axes(dims, axis))


def axis_groups(dims: ParallelDims, axis: str) -> list[tuple[int, ...]]:
    """Every group of global ranks along the planner's `axis`, as the runtime's mesh builds them: the
    dims' own rank grid (`ParallelDims.groups`, the grid ParallelMesh's DeviceMesh is built on), so a new
    mesh order or axis moves the planner's groups (and its inside-a-node test) with it."""
    return [tuple(sorted(g)) for g in dims.groups(*planner_axes(dims, axis))]


@lru_cache(maxsize=4096)
def axis_inside_node(dims: ParallelDims, axis: str, gpus_per_node: int) -> bool:
    """Every group of `axis` sits on one node (global rank // gpus_per_node)."""
    return all(g[0] // gpus_per_node == g[-1] // gpus_per_node for g in axis_groups(dims, axis))


KEYS = {"tp": int, "pp": int, "dp": int, "ep": int, "cp": int, "cp_mode": str, "sp": int, "sp_mode": str,
        "sequence_parallel": bool, SPLIT_GATHER: bool, "zero": int, "precision": str,
        "microbatches": int, "mb": int, "microbatch_size": int, "checkpointing": bool, "ckpt": bool,
        "cpu_offload": bool, "offload": bool, "chunks": int, "num_model_chunks": int, "dp_replicate": int,
        "loss_chunk": int}
# sp= and sp_mode= are ColossalAI's words for cp (sp_size, sequence_parallelism_mode): its users type them
ALIASES = {"mb": "microbatches", "ckpt": "checkpointing", "offload": "cpu_offload", "chunks": "num_model_chunks",
           "sp": "cp", "sp_mode": "cp_mode", SPLIT_GATHER: "sequence_parallel"}
# a bare name means =1 (describe() writes them so)
FLAGS = ("ckpt", "checkpointing", "offload", "cpu_offload", SPLIT_GATHER)
# the keys an error lists, each once: the short forms (not the long names they stand for), not ColossalAI's words
SHOWN = sorted(set(KEYS) - {"sp", "sp_mode", SPLIT_GATHER, "microbatches", "checkpointing", "cpu_offload",
                            "num_model_chunks"})


def layout_fields(text: str) -> dict:
    """The fields `text` names, in `--layout`'s syntax or `Layout.describe()`'s (so a table row is
    accepted back): key=value items, a bare precision (`bf16`), bare flags (`ckpt`, `offload`),
    `mb=MxS` (micro-batches x their size), `cp=N(mode)`; ColossalAI's `sp=N`, `sp_mode=mode` and
    `sp=N(mode)` for cp, where `sp=split_gather` and `sp_mode=split_gather` (its sequence_parallelism_mode)
    mean Megatron sequence parallelism over tp."""
    out: dict = {}
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep and key in PRECISIONS:
            out["precision"] = key
            continue
        if not sep and key in FLAGS:
            key, raw = key, "1"
        elif not sep or key not in KEYS:
            raise ValueError(f"--layout item {item!r}: expected key=value with key in ({', '.join(SHOWN)}; "
                             f"ColossalAI's sp, sp_mode for cp, cp_mode), a precision ({', '.join(PRECISIONS)}) or "
                             f"a flag ({', '.join(f for f in FLAGS if f in SHOWN or f == SPLIT_GATHER)})")
        out.update(_field(key, raw, item))
    return out


def _field(key: str, raw: str, item: str) -> dict:
    """One item's fields (the describe() forms of mb and cp, and ColossalAI's sp forms, included)."""
    if key == "mb" and "x" in raw:
        count, _, size = raw.partition("x")
        return {"microbatches": _number(count, item, 1), "microbatch_size": _number(size, item, 1)}
    if key in ("sp", "sp_mode") and raw == SPLIT_GATHER:
        return {"sequence_parallel": True}
    if key in ("cp", "sp") and raw.endswith(")") and "(" in raw:
        size, _, mode = raw[:-1].partition("(")
        return {"cp": _number(size, item, 1), "cp_mode": mode}
    if key in ("ckpt", "checkpointing") and raw in CHECKPOINTING:       # ckpt=selective, ckpt=full
        return {"checkpointing": raw}
    kind = KEYS[key]
    if kind is bool:
        if raw.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            modes = f", {key}={CHECKPOINTING[1]}" if ALIASES.get(key, key) == "checkpointing" else ""
            raise ValueError(f"--layout item {item!r}: expected {key}=1 or {key}=0{modes}")
        return {ALIASES.get(key, key): raw.lower() in ("1", "true", "yes", "on")}
    return {ALIASES.get(key, key): _number(raw, item, 0 if key == "zero" else 1) if kind is int else raw}


def _number(raw: str, item: str, low: int) -> int:
    if not raw.strip().isdigit() or int(raw) < low:
        raise ValueError(f"--layout item {item!r}: {raw!r} is not a whole number >= {low}")
    return int(raw)


def parse_layout(text: str, **defaults) -> Layout:
    """'tp=2,pp=2,zero=1,ckpt=1' (or a table row's 'tp=2,pp=1,dp=4,zero=1,bf16,mb=1x8,ckpt') -> a Layout
    (unnamed fields from `defaults`, then Layout's)."""
    return Layout.of(**{**defaults, **layout_fields(text)})


def plugin_config(layout: Layout):
    """The `HybridParallelConfig` the layout stands for: built here so the plugin's own validation
    raises its own errors for a layout the plugin refuses."""
    from meshboost.optim import PrecisionConfig, ZeroConfig
    from meshboost.pipeline import PipelineConfig
    from meshboost.plugins.config import HybridParallelConfig
    from meshboost.shardformer import ShardConfig

    if layout.pp > 1:
        pipeline = PipelineConfig(num_microbatches=layout.microbatches,
                                  pp_style="interleaved" if layout.num_model_chunks > 1 else "1f1b",
                                  num_model_chunks=layout.num_model_chunks)
    else:
        pipeline = PipelineConfig()
    # checkpointing: the plugin turns it on at boost in the layout's mode, on every layer (its default
    # without a PipelineGradientCheckpointConfig); the chunked loss: ShardConfig's. The layout's record goes
    # through whole (its dp too: the mesh checks it against the world it runs on)
    return HybridParallelConfig(dims=layout.dims, pipeline=pipeline, precision=PrecisionConfig(layout.precision),
                                zero=ZeroConfig(stage=layout.zero, cpu_offload=layout.cpu_offload),
                                checkpointing=layout.checkpointing,
                                sharding=ShardConfig(loss_chunk_tokens=layout.loss_chunk))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def sequence_options(tp: int, cp: int, context: bool, split_gather: bool) -> list[dict]:
    """The sequence splits to try at (tp, cp), as Layout fields: the context modes when cp > 1; plain
    tensor parallelism and, at tp > 1, split_gather (Megatron sequence parallelism over tp) when cp = 1."""
    if cp > 1:
        return [dict(cp_mode=mode) for mode in CONTEXT_MODES] if context else []
    return [{}, dict(sequence_parallel=True)] if split_gather and tp > 1 else [{}]


def enumerate_layouts(world: int, global_batch: int, num_layers: int, precision: str, gpus_per_node: int,
                      zero_stages=(0, 1, 2), checkpointing=(None, FULL), num_experts: int = 0,
                      context: bool = False, split_gather: bool = False, loss_chunk: int | None = None) -> list[Layout]:
    """Every (tp, cp, pp, dp) factorisation of `world` with tp x cp inside a node (the tp and cp groups
    are adjacent in the mesh), pp <= layers, dp dividing the global batch, each with ZeRO stages,
    checkpointing, and micro-batch counts dividing the per-replica batch (at least pp of them; without
    a pipeline they are gradient-accumulation steps, the user's loop under `booster.no_sync`); for an
    MoE of `num_experts` experts, every ep dividing both dp and the experts; `context`: cp > 1 in
    both context modes; `split_gather`: Megatron sequence parallelism at tp > 1; under ZeRO-3, HSDP's
    replica counts (`replica_options`); every one with `loss_chunk` (the chunked loss). The model's own
    checks (tp dividing heads, sequence lengths, ...) run later."""
    out = []
    for tp in divisors(world):
        if tp > gpus_per_node:
            continue
        for cp in divisors(world // tp) if context else [1]:
            if tp * cp > gpus_per_node:
                continue
            for pp in divisors(world // tp // cp):
                dp = world // tp // cp // pp
                if pp > num_layers or global_batch % dp:
                    continue
                per_replica = global_batch // dp
                counts = sorted({m for m in (1, 2, 4, 8, pp, 2 * pp, 4 * pp, 8 * pp, per_replica)
                                 if pp <= m <= per_replica and per_replica % m == 0} or {per_replica})
                eps = [e for e in divisors(dp) if num_experts and num_experts % e == 0] or [1]
                splits = sequence_options(tp, cp, context, split_gather)
                for split, ep, m, zero, ckpt in product(splits, eps, counts, zero_stages, checkpointing):
                    base = Layout.of(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, zero=zero, precision=precision,
                                     microbatches=m, microbatch_size=per_replica // m, checkpointing=ckpt,
                                     loss_chunk=loss_chunk, **split)
                    out += [replace(base, dims=replace(base.dims, dp_replicate=r))
                            for r in replica_options(base, gpus_per_node)]
    return out


def replica_options(layout: Layout, gpus_per_node: int) -> list[int]:
    """HSDP's replica counts to try for a ZeRO-3 layout: 1 (plain ZeRO-3 over dp x cp) and every divisor
    of dp whose shard groups sit inside one node when the world spans several (the replicas' all-reduce
    of one shard is what crosses nodes); [1] for ZeRO-0/1/2 (HSDP is FSDP2's)."""
    if layout.zero != 3:
        return [1]
    multi_node = layout.world > gpus_per_node
    return [r for r in divisors(layout.dp) if r == 1 or not multi_node
            or axis_inside_node(replace(layout.dims, dp_replicate=r), "dp", gpus_per_node)]
