"""The planner: one model and one cluster in, the valid layouts with their predicted memory per rank,
communication per axis and relative step time out.

Owns: `Planner` (the model read once, on meta; per-tp splits, per-pp stage holdings, each rank's state
and each layout's activation model cached), `Planner.explain(layout)` (every check the plugin and the
sharder would make, then the estimate of every rank, reported as the worst rank and per stage),
`Planner.rank()` (ranking.py: every enumerated layout that passes the checks and fits the memory,
fastest first) and `plan(...)`, the one-call Python entry (`meshboost.plan(...)`). Memory rules live in
memory.py and activations.py, parameter placement in params.py, traffic in traffic.py, time in cost.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from meshboost.plan import activations, cost, emulate, fakecache, memory, params, peak, sharded, traffic
from meshboost.plan import reference as plan_reference      # a frozen reference model's row
from meshboost.plan.checks import check_cluster, check_sequence
from meshboost.plan.layout import FULL, SPLIT_GATHER, Layout, enumerate_layouts, plugin_config
from meshboost.plan.lora import adapted, check_layout, dequant_scratch, mark_quantized, with_options
from meshboost.plan.model import build_meta_model, load_config, model_class

GIB = 2 ** 30
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "top_k")
MEMORY_KEYS = ("weights", "gradients", "optimizer_states", "masters", "activations", "buffers")


@dataclass
class Estimate:
    """The prediction for one layout: the worst rank's memory, per stage, traffic and time."""

    layout: Layout
    memory_bytes_per_rank: dict
    per_stage: list[dict]
    comm_bytes_per_step: dict
    step_seconds: float
    fits: bool
    notes: list[str] = field(default_factory=list)
    relative_step_time: float = 1.0

    def plugin_config(self):
        """The `HybridParallelConfig` of this layout (the plugin's own validation ran on it)."""
        return plugin_config(self.layout)

    def plugin(self):
        """The `HybridParallelPlugin` that runs this layout (build it under torchrun, on every rank)."""
        from meshboost.plugins import HybridParallelPlugin

        return HybridParallelPlugin(self.plugin_config())

    def as_dict(self) -> dict:
        return {"layout": self.layout.as_dict(), "memory_bytes_per_rank": self.memory_bytes_per_rank,
                "per_stage": self.per_stage, "comm_bytes_per_step": self.comm_bytes_per_step,
                "step_seconds": self.step_seconds, "relative_step_time": self.relative_step_time,
                "fits": self.fits, "notes": self.notes}


class Planner:
    """Plans for `model` (an HF folder, a config.json, a model type, or a transformers config) on
    `gpus` devices of `memory_gb` GiB (`gpus_per_node` each node), sequences of `seq` tokens and
    `global_batch` sequences per step. `device` ("cuda", the default: the GPUs planned for, whatever
    this machine holds; or "cpu"): whose kernels' temporaries and allocator the peak model (peak.py)
    predicts. `lora`: `LoraOptions` or None. `reference`: True or "offload", a reference's row (plan/reference.py)."""

    def __init__(self, model, overrides: dict | None = None, *, architecture: str | None = None, gpus: int = 8,
                 nodes: int = 1, memory_gb: float = 80.0, seq: int = 2048, global_batch: int = 8,
                 precision: str = "bf16", constants: cost.CostConstants | None = None,
                 make_vocab_size_divisible_by: int = 64, device: str = "cuda", lora=None, reference=None):
        check_cluster(gpus, nodes, memory_gb, global_batch)
        self.reference = plan_reference.check_option(reference)     # None: no reference model
        self.config = load_config(model, overrides)
        self.cls = model_class(self.config, architecture)
        self.lora, self.meta = lora, adapted(build_meta_model(self.config, architecture), lora)   # plan/lora.py
        check_sequence(self.meta, seq)
        self.gpus, self.nodes, self.gpus_per_node = gpus, nodes, gpus // nodes
        self.memory_bytes, self.seq, self.global_batch, self.precision = memory_gb * GIB, seq, global_batch, precision
        if device not in peak.DEVICES:
            raise ValueError(f"device {device!r}: the peak model predicts one of {peak.DEVICES}")
        self.device = device            # whose temporaries and allocator the peak is
        if constants is None:
            from meshboost.plan.calibrate import default_constants
            constants = default_constants()          # a known GPU's, else H100-class defaults
        self.constants = constants
        self.vocab_multiple = make_vocab_size_divisible_by
        self.num_layers = activations.count_layers(self.config)
        self.hidden = getattr(self.config, "hidden_size", None) or getattr(self.config, "n_embd")
        from meshboost.shardformer import uses_causal_lm_loss
        self.vocab_parallel_loss = uses_causal_lm_loss(self.meta)
        self.lm_head = self.meta.get_output_embeddings() is not None
        self._splits: dict[int, dict] = {}
        self._holdings: dict[tuple[int, int], list] = {}
        self._experts, self._roles = {}, {}        # {tp: set of expert ids}, {tp: emulate.SequenceRoles}
        self._shards: dict[tuple, list] = {}
        self._activations: dict[tuple, activations.ActivationModel] = {}
        self._stage_peaks: dict[tuple, peak.StageActivations] = {}
        self._context_checked: set[tuple] = set()
        self._rank_states: dict[tuple, dict] = {}
        self._lora_configs: dict[bool, object] = {}
        self.checked_candidates, self.state_bounds = {}, {}   # ranking.py's: per keywords, per what a bound reads
        from meshboost.shardformer.layers.expert_parallel import experts_modules
        self.expert_paths = {path for path, _ in experts_modules(self.meta)}
        self.top_k = next((getattr(self.config, f) for f in TOP_K_FIELDS
                           if isinstance(getattr(self.config, f, None), int)), 0)

    # -- cached placement ---------------------------------------------------------------------------
    def splits(self, tp: int) -> dict:
        if tp not in self._splits:
            self._splits[tp] = params.tp_splits(self.meta, tp, self.vocab_multiple)
        return self._splits[tp]

    def experts(self, ep: int) -> set:
        """id(param) of the expert weights ep ranks split (the plugin's refusals for a model or ep it
        cannot split)."""
        if ep not in self._experts:
            self._experts[ep] = params.expert_params(self.meta, ep)
        return self._experts[ep]

    def sequence_roles(self, tp: int) -> emulate.SequenceRoles:
        """split_gather's plan at `tp` (the sharder's refusals for a model it cannot split)."""
        if tp not in self._roles:
            self._roles[tp] = emulate.sequence_roles(self.meta, tp, self.vocab_multiple)
        return self._roles[tp]

    def shards(self, layout: Layout, pp_rank: int, tp_rank: int) -> list:
        """The trainable parameters one (pp, tp) rank holds, the frozen as `.frozen` (one list per rank, reused)."""
        key = (layout.tp, layout.pp, layout.num_model_chunks, layout.ep, pp_rank, tp_rank)
        if key not in self._shards:
            self._shards[key] = mark_quantized(self.lora, params.rank_shards(     # QLoRA: NF4 bases (plan/lora.py)
                self.meta, self.splits(layout.tp), self.holdings(layout.pp, layout.num_model_chunks)[pp_rank],
                tp_rank, layout.tp, self.experts(layout.ep), layout.ep))
        return self._shards[key]

    def holdings(self, pp: int, chunks: int = 1) -> list:
        if (pp, chunks) not in self._holdings:
            self._holdings[pp, chunks] = params.stage_holdings(self.meta, pp, chunks)
        return self._holdings[pp, chunks]

    def layer_counts(self, layout: Layout) -> list[int]:
        """Layers each pipeline rank holds: virtual stage v = chunk x pp + rank (build_stages' rule)."""
        from meshboost.pipeline import split_layers
        ranges = split_layers(self.num_layers, layout.pp * layout.num_model_chunks)
        return [sum(len(ranges[v]) for v in range(r, len(ranges), layout.pp)) for r in range(layout.pp)]

    # -- checks -------------------------------------------------------------------------------------
    def check(self, layout: Layout) -> None:
        """Raise what the planner (not modelled yet), the plugin, the sharder or the pipeline would
        raise for `layout` on this model and world."""
        plugin_config(layout)                       # the plugin's own validation and messages
        layout.dims.resolved(layout.world)          # the factorisation's one check (dims.py), as the mesh runs it
        self.splits(layout.tp)                      # the sharder's checks (heads divisible by tp, ...)
        if layout.sequence_parallel and layout.tp > 1:     # split_gather: the sharder's and the split's checks
            from meshboost.shardformer.sequence import check_length
            self.sequence_roles(layout.tp)
            check_length(self.seq, layout.tp)
        if layout.cp > 1:                           # context parallelism's checks, with its messages
            from meshboost.shardformer.context_checks import check_context, check_length
            if (layout.cp, layout.tp, layout.cp_mode) not in self._context_checked:     # the model's: once each
                check_context(self.meta, layout.cp, layout.tp, layout.cp_mode)
                self._context_checked.add((layout.cp, layout.tp, layout.cp_mode))
            check_length(self.seq, layout.cp, layout.cp_mode)
        self.experts(layout.ep)                     # expert parallelism's (ep dividing every layer's experts, ...)
        check_layout(self.lora, layout)             # what the planner does not model of LoRA yet
        self.holdings(layout.pp, layout.num_model_chunks)   # the pipeline's (at most one stage per layer, ...)
        if layout.world != self.gpus:
            raise ValueError(f"layout {layout.describe()} uses tp x pp x dp x cp = {layout.world} ranks, but the world "
                             f"has --gpus {self.gpus}")
        per_step = layout.dp * layout.microbatches * layout.microbatch_size
        if per_step != self.global_batch:
            raise ValueError(f"layout {layout.describe()}: dp x microbatches x microbatch_size = {per_step} "
                             f"sequences per step, but --global-batch is {self.global_batch}")

    # -- one rank ----------------------------------------------------------------------------------
    def rank_state(self, layout: Layout, pp_rank: int = 0, tp_rank: int = 0, dp_rank: int = 0) -> dict:
        """{weights, gradients, masters, optimizer_states} bytes predicted for one rank after backward
        (what `memory_breakdown` measures there); `layout` must have passed `check`."""
        device, host = self._state(layout, self.shards(layout, pp_rank, tp_rank), dp_rank)
        return {**device, **{k: host[k] for k in ("masters", "optimizer_states") if k in host}}

    def rank_comm(self, layout: Layout, pp_rank: int = 0, tp_rank: int = 0) -> dict:
        """{axis: [(op, payload bytes)]} of one rank's step, as `dispatched_comm_counter` counts it."""
        return traffic.rank_traffic(self, layout, self.shards(layout, pp_rank, tp_rank),
                                    self.layer_counts(layout)[pp_rank], pp_rank == 0, pp_rank == layout.pp - 1,
                                    self._activation_model(layout).summed_per_layer)

    def _state(self, layout: Layout, shards, dp_rank: int) -> tuple[dict, dict]:
        """(device bytes {weights, gradients, masters, optimizer_states}, host bytes by kind) of one rank."""
        if layout.zero == 3:
            return sharded.fsdp_rank_state(layout, shards, dp_rank), {}
        state = memory.state_bytes(shards, layout.precision, layout.zero, layout.grad_replicas, dp_rank, layout.pp,
                                   ep_size=layout.ep)
        return sharded.offload_split(state, layout.precision, layout.zero) if layout.cpu_offload else (state, {})

    def rank_memory(self, layout: Layout, pp_rank: int, tp_rank: int, dp_rank: int, activation_bytes: int) -> dict:
        """One rank's state after backward by kind (MEMORY_KEYS, their `total`, and `host` under cpu
        offload), its saved activations being `activation_bytes` (the rest computed once per rank)."""
        key = (layout, pp_rank, tp_rank, dp_rank)
        if key not in self._rank_states:
            shards = self.shards(layout, pp_rank, tp_rank)
            mem, host = self._state(layout, shards, dp_rank)
            mem["buffers"] = self._buffers(layout, shards, dp_rank)
            if host:                    # cpu_offload: host memory, outside the device total
                mem["host"] = sum(host.values())
            self._rank_states[key] = {k: int(v) for k, v in mem.items()}
        state = {**self._rank_states[key], "activations": int(activation_bytes)}
        mem, host = plan_reference.with_row(self, {k: state[k] for k in MEMORY_KEYS}, layout, pp_rank, tp_rank, dp_rank,
                                            state.get("host"))
        return {**mem, "total": sum(mem.values()), **host}            # host bytes: outside the device total

    def _buffers(self, layout: Layout, shards, dp_rank: int) -> int:
        if layout.zero == 3:     # FSDP2's gathers and reductions, and its shards' padding rows
            return sharded.fsdp_rank_buffers(layout, shards, dp_rank, self.layer_prefixes)
        return memory.buffer_bytes(shards, layout.precision, layout.zero, layout.grad_replicas, layout.pp,
                                   ep_size=layout.ep) + dequant_scratch(shards, layout.precision)

    @cached_property
    def layer_prefixes(self) -> list[str]:
        """FSDP2's units under zero=3: meshboost's `transformer_layers` (the rest is the root's)."""
        from meshboost.plugins.fsdp_wrap import transformer_layers
        return [name for name, _ in transformer_layers(self.meta)]

    def stage_activations(self, layout: Layout, pp_rank: int = 0, in_flight: int | None = None) -> int:
        """Bytes saved for backward on pipeline rank `pp_rank` at its peak: 1F1B holds min(pp - rank,
        microbatches) micro-batches of all its layers; the interleaved schedule min(W + 1, M x V)
        chunk-micro-batches, W = 2 (pp - rank - 1) + (V - 1) pp its warm-up forwards (Megatron's
        order), each of a chunk's layers (the rank's layers / V); 1 without a pipeline."""
        chunks, m = layout.num_model_chunks, layout.microbatches
        layers = self.layer_counts(layout)[pp_rank]
        last = pp_rank == layout.pp - 1
        model = self._activation_model(layout, pp_rank=pp_rank)
        if chunks > 1 and in_flight is None:
            units = min(2 * (layout.pp - pp_rank - 1) + (chunks - 1) * layout.pp + 1, m * chunks)
            return units * layers * model.per_layer // chunks + (model.ends if last else 0)
        if in_flight is None:
            in_flight = min(layout.pp - pp_rank, m) if layout.pp > 1 else 1
        return activations.stage_activation_bytes(model, layers, pp_rank == 0, last, in_flight)

    # -- the estimate -------------------------------------------------------------------------------
    def distinct_ranks(self, layout: Layout) -> tuple[list[int], list[int]]:
        """The tp and dp ranks whose holdings can differ (a stage's worst rank is one of them): every tp
        rank where some weight is replicated over part of tp (GQA), and the ends of ZeRO's partition."""
        splits = self.splits(layout.tp)
        tp_ranks = list(range(layout.tp)) if any(s.replicas > 1 for s in splits.values()) else [0]
        return tp_ranks, sorted({0, layout.grad_replicas - 1})

    def explain(self, layout: Layout) -> Estimate:
        self.check(layout)
        holdings = self.holdings(layout.pp, layout.num_model_chunks)
        tp_ranks, dp_ranks = self.distinct_ranks(layout)
        act_model = self._activation_model(layout)
        layer_counts = self.layer_counts(layout)
        stages, worst = [], None
        for pp_rank in range(len(holdings)):
            first, last = pp_rank == 0, pp_rank == layout.pp - 1
            act = self.stage_activations(layout, pp_rank)
            stage_worst = None
            for tp_rank in tp_ranks:
                shards = self.shards(layout, pp_rank, tp_rank)
                for dp_rank in dp_ranks:
                    mem = self.rank_memory(layout, pp_rank, tp_rank, dp_rank, act)
                    predicted = plan_reference.rank_peak(self, layout, pp_rank, tp_rank, shards, dp_rank, mem)
                    mem.update({k: predicted[k] for k in ("peak", "reserved", "outside", "instant", "device")})
                    if stage_worst is None or mem["peak"] > stage_worst[0]["peak"]:
                        stage_worst = (mem, shards, tp_rank, dp_rank)
            mem, shards, tp_rank, dp_rank = stage_worst
            comm = traffic.rank_traffic(self, layout, shards, layer_counts[pp_rank], first, last,
                                        act_model.summed_per_layer)
            breakdown: dict = {}
            seconds = plan_reference.copy_seconds(self, mem, breakdown) + cost.step_seconds(
                layout, sum(s.numel for s in shards), layer_counts[pp_rank], self.hidden, self.seq, comm,
                self.gpus_per_node, self.constants, ends=first or last, zero_buckets=traffic.zero_buckets(self, layout,
                shards), breakdown=breakdown, frozen_numel=sum(s.numel for s in shards.frozen))
            stages.append({"pp_rank": pp_rank, "layers": layer_counts[pp_rank], "worst_tp_rank": tp_rank,
                           "worst_dp_rank": dp_rank, "memory_bytes": mem, "step_seconds": seconds,
                           "step_seconds_terms": breakdown,
                           "comm_bytes_per_step": {axis: sum(n for _, n in ops) for axis, ops in comm.items()}})
            if worst is None or mem["peak"] > worst["memory_bytes"]["peak"]:
                worst = stages[-1]
        notes = [] if act_model.exact_tp else [
            f"activations at tp={layout.tp}: {type(self.config).__name__} has no per-rank config (head_dim tied to "
            "the hidden size); approximated: 4 hidden-sized tensors per layer and 2 at the ends whole, the rest / tp"]
        if self.num_experts:
            notes.append("MoE: activations and ep traffic per rank depend on the routing; predicted for the mean "
                         "rank (tokens x top_k rows per rank, what the ep group receives in all), and the flops "
                         "count every expert's parameters (the cost model is dense)")
        notes += (["split_gather at tp=1 splits nothing (the plugin runs plain data parallelism)"]
                  if layout.sequence_parallel and layout.tp == 1 else []) + plan_reference.notes(self, layout)
        seconds = max(s["step_seconds"] for s in stages)
        comm = {axis: max(s["comm_bytes_per_step"][axis] for s in stages) for axis in stages[0]["comm_bytes_per_step"]}
        return Estimate(layout, worst["memory_bytes"], stages, comm, seconds,
                        peak.needed_bytes(worst["memory_bytes"]) <= self.memory_bytes, notes)

    def activation_key(self, layout: Layout, body: bool = False, pp_rank: int = 0) -> tuple:
        """What `_activation_model` reads of `layout` (the layouts sharing a key share their fake runs)."""
        split = self._sequence_split(layout)
        return (layout.microbatch_size, layout.precision, layout.tp, layout.checkpointing,
                None if split is None else (split.mode, split.size), body, layout.ep,
                self.lora is not None and pp_rank > 0, layout.loss_chunk)

    def stage_peak_activations(self, layout: Layout, pp_rank: int) -> peak.StageActivations:
        """`peak.stage_activations` of one pipeline rank (the same for each of its tp and dp ranks)."""
        if (layout, pp_rank) not in self._stage_peaks:
            self._stage_peaks[layout, pp_rank] = peak.stage_activations(self, layout, pp_rank)
        return self._stage_peaks[layout, pp_rank]

    def _activation_model(self, layout: Layout, body: bool = False, pp_rank: int = 0) -> activations.ActivationModel:
        key = self.activation_key(layout, body, pp_rank)
        model = self._activations.get(key)
        if model is None:
            model = self._measured_activations(layout, body, pp_rank)
            if not fakecache.recording():           # a recording pass's figures are placeholders'
                self._activations[key] = model
        return model

    def _measured_activations(self, layout: Layout, body: bool, pp_rank: int) -> activations.ActivationModel:
        vocab, padded = getattr(self.config, "vocab_size", None), None
        if isinstance(vocab, int) and layout.tp > 1:
            multiple = self.vocab_multiple * layout.tp
            padded = -(-vocab // multiple) * multiple
        later = self.lora is not None and pp_rank > 0
        if later not in self._lora_configs:        # LoRA: a later stage's input needs grad
            self._lora_configs[later] = with_options(self.config, self.lora, later_stage=later)
        config = self._lora_configs[later]
        return activations.activation_model(self.cls, config, layout.microbatch_size, self.seq,
                                            layout.precision, layout.tp, padded, layout.checkpointing,
                                            self._sequence_split(layout), body, layout.ep, layout.loss_chunk)

    def _sequence_split(self, layout: Layout) -> activations.SequenceSplit | None:
        if layout.cp > 1:
            return activations.SequenceSplit(layout.cp_mode, layout.cp)
        if layout.sequence_parallel and layout.tp > 1:
            return activations.SequenceSplit(SPLIT_GATHER, layout.tp, self.sequence_roles(layout.tp))
        return None

    @property
    def num_experts(self) -> int:
        return next((getattr(self.config, f) for f in MOE_FIELDS if isinstance(getattr(self.config, f, None), int)), 0)

    # -- search -------------------------------------------------------------------------------------
    def candidates(self, zero_stages=(0, 1, 2), checkpointing=(None, FULL), loss_chunk=None) -> list[Layout]:
        return enumerate_layouts(self.gpus, self.global_batch, self.num_layers, self.precision, self.gpus_per_node,
                                 zero_stages, checkpointing, self.num_experts, context=self.context_parallel_ok,
                                 split_gather=True, loss_chunk=loss_chunk)

    @cached_property
    def context_parallel_ok(self) -> bool:
        """The model is one context parallelism runs (a causal LM on sdpa or eager attention)."""
        from meshboost.shardformer.context_checks import check_context
        try:
            check_context(self.meta, 1, 1)
        except (ValueError, NotImplementedError):
            return False
        return True

    def rank(self, include_unfit: bool = False, **kwargs) -> tuple[list[Estimate], list[tuple[Layout, str]]]:
        """(estimates of every valid layout that fits, fastest first, and with `include_unfit` those that
        do not after them, smallest peak first; [(layout, why refused)]). Keywords: `candidates`'."""
        from meshboost.plan.ranking import rank

        return rank(self, include_unfit, **kwargs)


def plan(model, overrides: dict | None = None, layout: Layout | dict | str | None = None, **kwargs):
    """`meshboost.plan(model, ...)`: the ranked fitting layouts (a list of `Estimate`), or, with `layout` (a
    Layout, a dict of its fields or 'tp=2,pp=2,zero=1'), that layout's `Estimate`. Keywords: `Planner`'s."""
    from meshboost.plan.layout import parse_layout

    planner = Planner(model, overrides, **kwargs)
    if layout is None:
        return planner.rank()[0]
    if isinstance(layout, str):
        layout = parse_layout(layout, precision=planner.precision, **_default_batching(planner, layout))
    elif isinstance(layout, dict):
        layout = Layout.of(**{"precision": planner.precision, **layout})
    return planner.explain(layout)


def _default_batching(planner: Planner, text: str) -> dict:
    """dp, micro-batches and micro-batch size a --layout leaves out: dp from the world, micro-batches of
    one sequence (or as many as the given micro-batch size leaves), so that dp x microbatches x
    microbatch_size is the global batch."""
    from meshboost.distributed.dims import ParallelDims
    from meshboost.plan.layout import DIMS_FIELDS, layout_fields

    named = layout_fields(text)     # no Layout yet: its record would check ep against a dp still to come
    given = ParallelDims(**{k: v for k, v in named.items() if k in DIMS_FIELDS})
    out = {}
    dp = given.dp
    if dp is None:
        dp = out["dp"] = max(1, planner.gpus // (given.tp * given.pp * given.cp))
    per_replica = max(1, planner.global_batch // dp)
    if "microbatches" in named:
        if "microbatch_size" not in named:
            out["microbatch_size"] = max(1, per_replica // named["microbatches"])
    else:
        out["microbatches"] = max(1, per_replica // named.get("microbatch_size", Layout.microbatch_size))
    return out
