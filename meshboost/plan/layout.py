"""A candidate parallel layout, the plugin config it stands for, and the enumeration of valid ones.

Owns: `Layout` (tp, pp, dp, ep, sp, ZeRO stage, precision, micro-batches and their size, activation
checkpointing), parsing `--layout tp=2,pp=2,zero=1,...`, building the `HybridParallelConfig` a layout
stands for (so the plugin's own checks raise their own messages: nothing is copied here), refusing
the axis the planner does not model yet (sp), and enumerating every factorisation of the world (and
ep, for an MoE) that the model and the plugin accept. Must not
estimate memory or time (memory.py, cost.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from meshboost.plan.params import NOT_MODELLED

PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Layout:
    """One layout the plugin can run: the mesh sizes (tp x pp x dp x sp = the world; ep splits the
    experts over ep of the dp ranks), the ZeRO stage, precision, micro-batching and the memory switches."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    precision: str = "bf16"
    ep: int = 1                     # experts split over ep of the dp ranks (ep divides dp)
    sp: int = 1                     # > 1: refused, not modelled yet
    zero: int = 0                   # 0, 1, 2 (meshboost's ZeRO), 3 (torch FSDP2)
    microbatches: int = 1
    microbatch_size: int = 1
    checkpointing: bool = False
    cpu_offload: bool = False
    num_model_chunks: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.sp

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        ckpt = ",ckpt" if self.checkpointing else ""
        ep = f",ep={self.ep}" if self.ep > 1 else ""
        ep += f",chunks={self.num_model_chunks}" if self.num_model_chunks > 1 else ""
        return (f"tp={self.tp},pp={self.pp},dp={self.dp}{ep},zero={self.zero},{self.precision},"
                f"mb={self.microbatches}x{self.microbatch_size}{ckpt}")


KEYS = {"tp": int, "pp": int, "dp": int, "ep": int, "sp": int, "zero": int, "precision": str,
        "microbatches": int, "mb": int, "microbatch_size": int, "checkpointing": bool, "ckpt": bool,
        "cpu_offload": bool, "offload": bool, "chunks": int, "num_model_chunks": int}
ALIASES = {"mb": "microbatches", "ckpt": "checkpointing", "offload": "cpu_offload", "chunks": "num_model_chunks"}


def parse_layout(text: str, **defaults) -> Layout:
    """'tp=2,pp=2,zero=1,ckpt=1' -> a Layout (unnamed fields from `defaults`, then Layout's)."""
    values = dict(defaults)
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or key not in KEYS:
            raise ValueError(f"--layout item {item!r}: expected key=value with key in {sorted(KEYS)}")
        kind = KEYS[key]
        raw = raw.strip()
        value = raw.lower() in ("1", "true", "yes", "on") if kind is bool else kind(raw)
        values[ALIASES.get(key, key)] = value
    return Layout(**values)


def refuse_unmodelled(layout: Layout) -> None:
    """NotImplementedError for the axes whose memory and traffic the planner does not model yet."""
    if layout.sp > 1:
        raise NotImplementedError(f"sp={layout.sp} (context parallelism): {NOT_MODELLED} by meshboost.plan; the "
                                  "plugin may run it, but the planner will not estimate it silently")


def plugin_config(layout: Layout):
    """The `HybridParallelConfig` the layout stands for: built here so the plugin's own validation
    raises its own errors for a layout the plugin refuses."""
    from meshboost.optim import PrecisionConfig, ZeroConfig
    from meshboost.pipeline import PipelineConfig
    from meshboost.plugins.config import HybridParallelConfig

    if layout.pp > 1:
        pipeline = PipelineConfig(pp_size=layout.pp, num_microbatches=layout.microbatches,
                                  pp_style="interleaved" if layout.num_model_chunks > 1 else "1f1b",
                                  num_model_chunks=layout.num_model_chunks)
    else:
        pipeline = PipelineConfig()
    # checkpointing: HF's gradient_checkpointing_enable() on every layer (the plugin's default without a
    # PipelineGradientCheckpointConfig); nothing in the config
    return HybridParallelConfig(tp_size=layout.tp, ep_size=layout.ep, sp_size=layout.sp, pipeline=pipeline,
                                precision=PrecisionConfig(layout.precision),
                                zero=ZeroConfig(stage=layout.zero, cpu_offload=layout.cpu_offload))


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(world: int, global_batch: int, num_layers: int, precision: str, gpus_per_node: int,
                      zero_stages=(0, 1, 2), checkpointing=(False, True), num_experts: int = 0) -> list[Layout]:
    """Every (tp, pp, dp) factorisation of `world` with tp inside a node, pp <= layers, dp dividing the
    global batch, each with ZeRO stages, checkpointing, and micro-batch counts dividing the per-replica
    batch (at least pp of them; without a pipeline they are gradient-accumulation steps, the
    user's loop under `booster.no_sync`); for an MoE of `num_experts` experts, every ep dividing both dp
    and the experts. The model's own checks (tp dividing heads, ...) run later."""
    out = []
    for tp in divisors(world):
        if tp > gpus_per_node:
            continue
        for pp in divisors(world // tp):
            dp = world // tp // pp
            if pp > num_layers or global_batch % dp:
                continue
            per_replica = global_batch // dp
            counts = sorted({m for m in (1, 2, 4, 8, pp, 2 * pp, 4 * pp, 8 * pp, per_replica)
                             if pp <= m <= per_replica and per_replica % m == 0} or {per_replica})
            eps = [e for e in divisors(dp) if num_experts and num_experts % e == 0] or [1]
            for ep in eps:
                for m in counts:
                    for zero in zero_stages:
                        for ckpt in checkpointing:
                            out.append(Layout(tp=tp, pp=pp, dp=dp, ep=ep, zero=zero, precision=precision,
                                              microbatches=m, microbatch_size=per_replica // m, checkpointing=ckpt))
    return out
