"""Predicted against measured per-rank memory for meshboost.plan, on this machine's CPUs:

    python benchmarks/plan_accuracy.py            # every case (several minutes on 2 cores)
    python benchmarks/plan_accuracy.py --quick    # a few cases
    python benchmarks/plan_accuracy.py --ranking  # predicted against measured step-time order

`--ranking` (benchmarks/plan_ranking.py): calibrates the cost constants first
(`meshboost.plan.calibrate`, the same processes and threads as the measurement), then for one model and
world (RANKING_SPEC, RANKING_LAYOUTS: a small Llama on 2 processes, tp / pp and its micro-batches / dp /
ZeRO / checkpointing / the sequence splits) boosts the model with each layout's plugin (all of them at once), runs RANKING_WARMUP rounds and times
RANKING_STEPS more (a round: one step of every layout, so that background load falls on all alike; per
layout the median of the slowest rank's step); `--repeat N` times (3 by default), each calibrating anew,
and prints the medians of measured against predicted seconds and their Spearman rank correlation.

For each case (a small Llama, GPT-2 or BERT under tp, pp, dp, ZeRO 1/2, fp32/bf16, checkpointing), N
processes boost the real model with the plugin config the planner builds for the layout, run one
step, then one more forward+backward and step, and measure on every rank: `memory_breakdown` after
that backward (weights, gradients, fp32 masters, optimizer states: counted from the tensors, padding
and replicas included); the bytes saved for backward (the parameters autograd saves left out: they
are the weights), without a pipeline by one forward (`saved_activation_bytes`, saved_tensors_hooks),
with one the peak alive at once over the schedule (`PeakSaved`: the same hooks, each saved tensor
counted until autograd frees it); and the payload bytes per axis that `comm_counter` records over
that forward+backward and step. The planner predicts the same rank from the config alone (meta
model). The table prints both and the relative error, the worst over ranks. `measure` and `compare`
are what tests/plan/test_plan.py calls; the cases' models, layouts, plugins and steps are plan_cases.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.plan_cases import (boost_layout, case_indices, forward_backward, layout_of, lora_of,  # noqa: E402
                                   planner_for, quiet, spawn_json, spec_of, write_json)

STATE_KEYS = {"weights": "working_weights", "gradients": "gradients", "masters": "fp32_masters",
              "optimizer_states": "optimizer_states"}

# (family, layout fields); the world is tp x pp x dp
CASES = [
    ("llama", dict(tp=2, precision="fp32")),
    ("llama", dict(tp=2, precision="bf16")),
    ("llama", dict(dp=2, zero=1, precision="bf16")),
    ("llama", dict(dp=2, zero=2, precision="fp32")),
    ("llama", dict(tp=2, dp=2, zero=1, precision="bf16")),
    ("llama", dict(pp=2, microbatches=2, precision="bf16")),
    ("llama", dict(pp=2, dp=2, zero=1, microbatches=2, precision="bf16")),
    ("llama", dict(tp=2, precision="bf16", checkpointing=True)),
    ("gpt2", dict(tp=2, precision="fp32")),
    ("gpt2", dict(dp=2, zero=2, precision="bf16")),
    ("gpt2", dict(pp=2, microbatches=2, precision="fp32")),
    ("gpt2", dict(tp=2, dp=2, zero=2, precision="bf16")),
    ("bert", dict(tp=2, precision="fp32")),
    ("bert", dict(tp=2, dp=2, zero=1, precision="bf16")),
    ("bert", dict(pp=2, microbatches=2, precision="bf16")),
    # dp=3: ZeRO buckets padded to a multiple of 3 (the last rank's shard holds the padding)
    ("llama", dict(dp=3, zero=1, precision="fp32")),
    ("gpt2", dict(dp=3, zero=2, precision="bf16")),
    ("bert", dict(dp=3, zero=1, precision="fp32")),
    ("llama", dict(tp=2, pp=2, microbatches=3, precision="bf16")),
    # GPT-2's LM head is tied to wte: vocab-parallel on both ends of the pipeline, its gradient summed
    ("gpt2", dict(tp=2, pp=2, microbatches=2, precision="bf16")),
    ("gpt2", dict(tp=2, precision="bf16", checkpointing=True)),
    # post-norm: the recompute re-runs both forward all-reduces of a layer (not modelled: shows as tp error)
    ("bert", dict(tp=2, precision="fp32", checkpointing=True)),
    # an MoE (Qwen3-MoE, 4 experts, top-2): experts cut over tp, dealt out over ep (ZeRO buckets of their own)
    ("qwen3_moe", dict(tp=2, precision="fp32")),
    ("qwen3_moe", dict(dp=2, ep=2, precision="fp32")),
    ("qwen3_moe", dict(dp=2, ep=2, zero=1, precision="bf16")),
    ("qwen3_moe", dict(dp=4, ep=2, zero=2, precision="fp32")),
    ("qwen3_moe", dict(tp=2, dp=2, ep=2, zero=1, precision="fp32")),
    ("qwen3_moe", dict(pp=2, microbatches=2, precision="fp32")),
    # the interleaved schedule: 2 chunks per rank, each 1 layer
    ("llama", dict(pp=2, microbatches=4, num_model_chunks=2, precision="fp32")),
    # ZeRO-3 (torch FSDP2: fp32 shards, dim 0 in ceil(d0 / dp) rows; dp=3 leaves the last rank fewer)
    ("llama", dict(dp=2, zero=3, precision="bf16")),
    ("llama", dict(dp=3, zero=3, precision="bf16")),
    ("gpt2", dict(tp=2, dp=2, zero=3, precision="fp32")),
    # cpu_offload: master shards and moments on the host (memory_breakdown counts them there)
    ("llama", dict(dp=2, zero=1, cpu_offload=True, precision="bf16")),
    ("gpt2", dict(dp=2, zero=2, cpu_offload=True, precision="fp32")),
    # sequence parallelism: Megatron's split_gather over tp (norms and residuals hold 1/tp of the sequence) ...
    ("llama", dict(tp=2, sequence_parallel=True, precision="fp32")),
    ("gpt2", dict(tp=2, sequence_parallel=True, precision="bf16", checkpointing=True)),
    ("llama", dict(tp=2, dp=2, zero=1, sequence_parallel=True, precision="bf16")),
    ("llama", dict(tp=2, pp=2, microbatches=2, sequence_parallel=True, precision="fp32")),
    # ... and context parallelism on a cp axis of its own (all_to_all: Ulysses; ring_attn: keys and
    # values gathered); ZeRO partitions over dp x cp
    ("llama", dict(cp=2, precision="fp32")),
    ("llama", dict(cp=2, cp_mode="ring_attn", precision="bf16")),
    ("llama", dict(cp=2, precision="fp32", checkpointing=True)),
    ("llama", dict(tp=2, cp=2, zero=1, precision="fp32")),
    ("llama", dict(cp=2, dp=2, zero=2, cp_mode="ring_attn", precision="bf16")),
    ("llama", dict(pp=2, cp=2, microbatches=2, precision="fp32")),
    # LoRA (peft through booster.enable_lora: rank-8 adapters on every linear but the head, the base frozen);
    # lora_rank / lora_targets are the planner's LoraOptions, not layout fields
    ("llama", dict(tp=2, precision="fp32", lora_rank=8)),
    ("llama", dict(dp=2, zero=1, precision="bf16", lora_rank=8)),
    ("llama", dict(precision="fp32", lora_rank=8, lora_targets="q_proj,v_proj")),
    ("llama", dict(tp=2, sequence_parallel=True, precision="bf16", lora_rank=8)),
    ("llama", dict(pp=2, microbatches=2, precision="bf16", lora_rank=8)),
    ("llama", dict(pp=2, microbatches=4, num_model_chunks=2, precision="fp32", lora_rank=8)),
    # HSDP: ZeRO-3 sharded over dp_shard = dp / dp_replicate, replicated over dp_replicate
    ("llama", dict(dp=4, dp_replicate=2, zero=3, precision="bf16")),
    # ZeRO-3 inside a pipeline
    ("llama", dict(pp=2, dp=2, zero=3, microbatches=2, precision="bf16")),
]
QUICK = [0, 2, 5, 8, 12, 23]
# Per rank, an MoE's activations and ep traffic follow the routing (rows received); compared as the
# mean over the ranks, which is what the planner predicts (tokens x top_k rows per rank)
# (and under tp the experts' f and g, on the rows received)
ROUTED = ("activations", "comm ep", "comm tp")


class PeakSaved:
    """Peak bytes autograd holds saved for backward while active, `model`'s parameters left out (a
    linear saves its weight: counted as weights): each saved view (counted once per storage, offset,
    shape and dtype) lives from its pack until its graph node frees it, which a
    pipeline does micro-batch by micro-batch; `peak` is the largest sum alive at once (1F1B's
    in-flight micro-batches on this stage)."""

    def __init__(self, model):
        self.live: dict = {}
        self.now = self.peak = 0
        self.weights = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}

    def pack(self, t):
        import torch.nn as nn
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
        # a saved parameter (or a view of one: FSDP2's unsharded parameters live in storage gathered per
        # forward): counted as weights
        if key[0] in self.weights or isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):
            return _Held(None, key, t)
        count, size = self.live.get(key, (0, t.numel() * t.element_size()))
        if count == 0:
            self.now += size
            self.peak = max(self.peak, self.now)
        self.live[key] = (count + 1, size)
        return _Held(self, key, t)

    def release(self, key) -> None:
        count, size = self.live[key]
        if count == 1:
            del self.live[key]
            self.now -= size
        else:
            self.live[key] = (count - 1, size)

    def hooks(self):
        import torch
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda held: held.tensor)


def _local(p):
    """A DTensor's local shard (FSDP2), else the tensor."""
    return p.to_local() if hasattr(p, "to_local") else p


class _Held:
    def __init__(self, owner: PeakSaved, key, tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        if self.owner is not None:
            self.owner.release(self.key)


def activation_bytes(module, run) -> int:
    """`saved_activation_bytes` of `run()`, less the saved views of `module`'s parameters."""
    from meshboost.optim.memory import saved_activation_bytes

    weights = {p.untyped_storage().data_ptr() for p in module.parameters()}
    _, saved, _ = saved_activation_bytes(run)
    return sum(n for key, n in saved.items() if key[0] not in weights)


def measure_rank(family: str, fields: dict) -> dict:
    """This rank's measured bytes for one case (call inside a process group of layout.world ranks)."""
    from benchmarks.models import make_batch
    from meshboost.distributed.profiling import comm_counter, dispatched_comm_counter
    from meshboost.optim.memory import memory_breakdown

    spec = spec_of(family)
    layout, plugin, booster, model, optimizer = boost_layout(fields, spec)
    mesh = plugin.mesh
    batch = make_batch(spec, mesh.dp_size, mesh.dp_rank, device=mesh.device)
    for _ in range(5):                     # until Adam has state (an fp16 step may be skipped)
        forward_backward(booster, model, optimizer, batch, layout.pp)
        optimizer.step()
        optimizer.zero_grad()
        if len(optimizer.unwrap().state):
            break
    peak = PeakSaved(model.unwrap())
    # zero=3: FSDP2 calls torch.distributed itself, so its dp traffic is what the dispatcher sees
    witness = dispatched_comm_counter(mesh) if layout.zero == 3 else contextlib.nullcontext()
    # under context parallelism the gradients are averaged over dp x cp: that group's traffic is dp's
    names = {mesh.group("dp", "cp"): "dp"} if mesh.cp_size > 1 else None
    with comm_counter(mesh, names) as counted, witness as dispatched:
        with peak.hooks():
            forward_backward(booster, model, optimizer, batch, layout.pp)
        measured = memory_breakdown(model.unwrap(), optimizer)
        optimizer.step()
    out = {key: measured[name] for key, name in STATE_KEYS.items()}
    out["comm"] = counted.summary()
    if dispatched is not None:
        out["comm"]["dp"] = dispatched.summary().get("dp", {"payload_bytes": 0})
    optimizer.zero_grad()
    if layout.pp == 1 and layout.zero != 3:
        micro = {k: v[:layout.microbatch_size] for k, v in batch.items()}
        out["activations"] = activation_bytes(model.unwrap(), lambda: model(**micro))
    else:    # the stage's peak over the schedule's micro-batches in flight (zero=3: its one micro-batch)
        out["activations"] = peak.peak
    # the dp coordinate as ZeRO partitions: this rank's index among the gradient's replicas (dp x cp)
    out["ranks"] = (mesh.pp_rank, mesh.tp_rank, mesh.reduction_of([])[3])
    # ep = dp may be one process group, whose traffic comm_counter then labels ep
    out["dp_is_ep"] = layout.ep > 1 and mesh.group("dp") is mesh.group("ep")
    out["dp_is_cp"] = layout.cp > 1 and mesh.group("dp", "cp") is mesh.group("cp")
    return out


def _worker(rank: int, world: int, cases: list, outdir: str) -> None:
    import torch.distributed as dist

    from benchmarks.release_check import free_case
    results = []
    for index, family, fields in cases:
        results.append((index, measure_rank(family, fields)))
        free_case()                        # the next case holds nothing of this one
        dist.barrier()
    write_json(outdir, rank, results)


def measure(cases: list[tuple[str, dict]]) -> list[list[dict]]:
    """[per case: [per rank: measured dict]] for cases that share one world size (spawned processes)."""
    spec_world = {layout_of(f, spec_of(fam)).world for fam, f in cases}
    if len(spec_world) != 1:
        raise ValueError("measure() takes cases of one world size")
    world = spec_world.pop()
    per_rank = spawn_json(_worker, world, [(i, fam, f) for i, (fam, f) in enumerate(cases)])
    return [[dict(per_rank[r][i][1]) for r in range(world)] for i in range(len(cases))]


def predict(family: str, fields: dict, ranks: tuple[int, int, int]) -> dict:
    spec = spec_of(family)
    layout = layout_of(fields, spec)
    planner = planner_for(spec, layout, lora_of(fields))
    planner.check(layout)
    out = planner.rank_state(layout, *ranks)
    out["activations"] = planner.stage_activations(layout, ranks[0])
    comm = planner.explain(layout).per_stage[ranks[0]]["comm_bytes_per_step"]
    out.update({f"comm {axis}": comm.get(axis, 0) for axis in COMM_AXES})
    return out


COMM_AXES = ("tp", "pp", "dp", "ep", "edp", "cp")


def measured_comm(summary: dict) -> dict:
    """Payload bytes per axis from `comm_counter`'s summary (the plan's axes are the mesh's names); a
    group labelled by its ranks (the stage group of weights tied across pipeline stages) counts as pp."""
    out = {f"comm {axis}": 0 for axis in COMM_AXES}
    for label, stats in summary.items():
        out[f"comm {label if label in COMM_AXES else 'pp'}"] += stats["payload_bytes"]
    return out


def compare(family: str, fields: dict, measured_ranks: list[dict]) -> dict:
    """{key: (worst relative error over ranks, measured, predicted of that rank)}; with ep > 1 the
    routed keys (ROUTED) compare the ranks' mean."""
    out = {}
    ranks = [{**m, **measured_comm(m["comm"])} for m in measured_ranks]
    predicted = [predict(family, fields, tuple(m["ranks"])) for m in ranks]
    routed = fields.get("ep", 1) > 1
    if ranks[0].get("dp_is_ep"):             # one group: comm_counter labels its traffic ep
        for q in predicted:
            q["comm ep"] += q.pop("comm dp")
    if ranks[0].get("dp_is_cp"):             # one group (dp x cp = cp, the world): comm_counter labels it cp
        for q in predicted:
            q["comm cp"] += q.pop("comm dp")
    for m, p in zip(ranks, predicted):
        for key in (*STATE_KEYS, "activations", *(f"comm {axis}" for axis in COMM_AXES)):
            if key not in m or key not in p:
                continue
            if routed and key in ROUTED:
                m = {**m, key: sum(r[key] for r in ranks) // len(ranks)}
                p = {**p, key: sum(q[key] for q in predicted) // len(predicted)}
            if key.startswith("comm") and not (m[key] or p[key]):
                continue
            err = abs(p[key] - m[key]) / max(m[key], 1)
            if key not in out or err > out[key][0]:
                out[key] = (err, m[key], p[key])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cases", default=None, help="comma list of CASES indices (e.g. 22,23) instead of all")
    parser.add_argument("--ranking", action="store_true", help="only the step-time ranking (calibrates first)")
    parser.add_argument("--constants", default=None, help="with --ranking: read the constants instead of calibrating")
    parser.add_argument("--repeat", type=int, default=3,
                        help="with --ranking: calibrate, measure and predict this many times; rank the medians")
    parser.add_argument("--runs-json", default=None,
                        help="with --ranking: also write each run's constants and measured seconds to this file")
    args = parser.parse_args()
    quiet()
    if args.ranking:
        from benchmarks.plan_ranking import ranking
        ranking(args.constants, repeat=args.repeat, runs_json=args.runs_json)
        return
    cases = [CASES[i] for i in case_indices(args.cases, QUICK if args.quick else range(len(CASES)))]
    by_world: dict[int, list] = {}
    for fam, f in cases:
        by_world.setdefault(layout_of(f, spec_of(fam)).world, []).append((fam, f))
    print(f"{'model':6s} {'layout':40s} {'kind':17s} {'measured':>11s} {'predicted':>11s} {'rel.err':>8s}")
    worst_state = worst_act = worst_comm = 0.0
    for world, group in sorted(by_world.items()):
        for (fam, f), ranks in zip(group, measure(group)):
            layout = layout_of(f, spec_of(fam))
            for key, (err, m, p) in compare(fam, f, ranks).items():
                if key == "activations":
                    worst_act = max(worst_act, err)
                elif key.startswith("comm"):
                    worst_comm = max(worst_comm, err)
                else:
                    worst_state = max(worst_state, err)
                print(f"{fam:6s} {layout.describe():40s} {key:17s} {m:11d} {p:11d} {100 * err:7.2f}%")
    print(f"worst relative error: weights/gradients/masters/optimizer states {100 * worst_state:.3f}%, "
          f"activations {100 * worst_act:.2f}%, communication payload per axis {100 * worst_comm:.2f}%")


if __name__ == "__main__":
    main()
