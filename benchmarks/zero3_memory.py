"""ZeRO-3 and HSDP: per-rank weights, gradients and optimizer states, and the bytes each mesh axis carries
in one training step, measured against the formulas, for a small Llama trained through the Booster with
`HybridParallelPlugin(zero_stage=3, tp_size=..., dp_replicate_size=...)` (FSDP2), fp32, on one spawn:

    python benchmarks/zero3_memory.py [--world 4] [--layouts dp4 hsdp2x2 tp2dp2 tp2rep2 sp2rep2] [--tiny]

A layout name reads: dpN (ZeRO-3 over N ranks), hsdpRxS (R replica groups of S shard ranks), tpT..,
spC.. (Ulysses context parallelism), repR (dp_replicate_size R); world = tp x sp x dp.

- Memory, per rank (`meshboost.optim.memory.memory_breakdown` after a backward, the moments from the
  step before): weights = gradients = 4 x P / (dp_shard x tp x stage share), AdamW's two moments twice
  that, where P is the unsharded model's parameter count and dp_shard the ranks of one replica group
  (times sp: FSDP2 shards over dp_shard x cp). Tensor parallelism leaves the norms whole on every tp
  rank and FSDP2 pads a dim it cannot split evenly, so each rank must be within 3%. ZeRO-3 does not
  take pipeline parallelism here yet: the stage share is 1.
- Traffic, per rank and axis, of one step (forward, backward, optimizer step) under
  `meshboost.distributed.profiling.dispatched_comm_counter` (every collective reaching torch's
  dispatcher, FSDP2's included), payload bytes (the full tensor of each collective). FSDP2 makes one
  unit per transformer layer plus the root (embeddings, final norm, LM head); U_i is unit i's tp-local
  parameter bytes, padded to a multiple of dp_shard rows:
      all-gather over the shard axis:      sum_i U_i in forward, again for every non-root unit in backward
                                            (ZeRO-3 frees gathered weights after forward; the root keeps them)
      reduce-scatter over the shard axis:  sum_i U_i, once per unit per step
      all-reduce over dp_replicate:        sum_i U_i / dp_shard (each replica group's reduced shard), once
  The other collectives (tp's activations, the 4-byte labelled-token count over dp) are printed as
  measured, without a formula here (docs/benchmarks.md, tp section, has tp's).

- The planner's prediction (`meshboost.plan`, from the config alone: `Planner.rank_state` and
  `rank_comm` for the rank's tp and dp coordinates) is printed in [brackets] beside each measured
  figure, and "planner eq" says whether every one equals the measurement exactly (no tolerance: the
  planner counts FSDP2's padding rows and units as the formula does).

Prints a table and one JSON line per layout (prefix "JSON "); `--tiny` (hidden 64, 2 layers, seq 16) is
what tests/benchmarks/test_zero3_memory_bench.py runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")      # before transformers loads; inherited by workers

import torch
import torch.distributed as dist

FP32, TOLERANCE = 4, 0.03
LAYOUT = re.compile(r"^(?:tp(?P<tp>\d+))?(?:sp(?P<sp>\d+))?(?:dp(?P<dp>\d+)|hsdp(?P<r>\d+)x(?P<s>\d+)|rep(?P<rep>\d+))?$")


def parse_layout(name: str, world: int) -> dict:
    """Plugin keywords of a layout name (see the module docstring); raises naming the name."""
    m = LAYOUT.match(name)
    if not m or not name:
        raise ValueError(f"layout {name!r}: expected e.g. dp4, hsdp2x2, tp2dp2, tp2rep2, sp2rep2")
    tp, sp = int(m["tp"] or 1), int(m["sp"] or 1)
    replicas = int(m["r"] or m["rep"] or 1)
    dp = int(m["dp"]) if m["dp"] else int(m["r"]) * int(m["s"]) if m["r"] else world // (tp * sp)
    if tp * sp * dp != world:
        raise ValueError(f"layout {name!r}: tp {tp} x sp {sp} x dp {dp} != --world {world}")
    kwargs = dict(tp_size=tp, zero_stage=3, dp_replicate_size=replicas)
    if sp > 1:
        kwargs.update(sp_size=sp, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
    return kwargs


def make_config(tiny: bool):
    """A Llama whose dims divide every layout's split (no vocab padding, every kv head split over tp)."""
    import transformers
    hidden, layers, vocab = (64, 2, 128) if tiny else (256, 4, 1024)
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=layers,
                                    max_position_embeddings=256, tie_word_embeddings=False)


def _units(model) -> list[tuple[bool, list]]:
    """(is the root, its own parameters) for every FSDP2 unit: a unit's parameters minus its sub-units'."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = {id(p): u for u in units for p in u.parameters()}       # the innermost unit wins: modules() is pre-order
    return [(u is model, [p for p in u.parameters() if inner[id(p)] is u]) for u in units]


def traffic_formula(model, dp_shard: int, replicas: int) -> dict:
    """Payload bytes per axis of one step (the module docstring's formula)."""
    def padded(p):                  # FSDP2 pads dim 0 to a multiple of the shard ranks
        rows = -(-p.shape[0] // dp_shard) * dp_shard
        return rows * (p.numel() // p.shape[0]) * FP32
    gather = scatter = 0
    for root, params in _units(model):
        size = sum(padded(p) for p in params)
        gather += size if root else 2 * size
        scatter += size
    out = {}
    if dp_shard > 1:
        out.update({"all_gather": gather, "reduce_scatter": scatter})
    if replicas > 1:
        out["all_reduce_replicas"] = scatter // dp_shard
    return out


def _measure(name: str, kwargs: dict, config, batch: int, seq: int) -> dict:
    """One layout: two steps, the second measured (memory after its backward, traffic of all of it)."""
    import transformers

    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.distributed.profiling import dispatched_comm_counter
    from meshboost.optim.memory import memory_breakdown

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    plugin = HybridParallelPlugin(**kwargs)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    mesh = plugin.mesh
    fsdp = mesh.fsdp_mesh()
    names = {fsdp.get_group(i): axis for i, axis in enumerate(fsdp.mesh_dim_names)}
    replicas, shard = mesh.dims.dp_replicate, fsdp.size(fsdp.ndim - 1)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    losses = []
    for step in range(2):           # the first makes AdamW's moments; the second is measured
        with dispatched_comm_counter(mesh, names) if step == 1 else contextlib.nullcontext() as counter:
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
            if step == 1:
                memory = memory_breakdown(model.unwrap(), opt)
            opt.step(), opt.zero_grad()
        losses.append(loss.item())
    traffic = {k: v["bytes_by_op"] for k, v in counter.summary().items()}
    # by group, not by name: a size-1 axis can make two names one group
    shard_axis, replica_axis = counter.label(fsdp.get_group(fsdp.ndim - 1)), counter.label(fsdp.get_group(0))
    got = {"all_gather": traffic.get(shard_axis, {}).get("all_gather", 0),
           "reduce_scatter": traffic.get(shard_axis, {}).get("reduce_scatter", 0)}
    if replicas > 1:
        got["all_reduce_replicas"] = traffic.get(replica_axis, {}).get("all_reduce", 0)
    formula = traffic_formula(model.unwrap(), shard, replicas)
    share = params / (shard * mesh.tp_size)
    theory = {"weights": FP32 * share, "gradients": FP32 * share, "optimizer_states": 2 * FP32 * share}
    mine = {"weights": memory["working_weights"], "gradients": memory["gradients"],
            "optimizer_states": memory["optimizer_states"]}
    return {"layout": name, "rank": dist.get_rank(), "params": params, "dp_shard": shard, "replicas": replicas,
            "tp": mesh.tp_size, "memory": mine, "memory_theory": theory,
            # the planner's (tp rank, dp rank): its dp ranks index the dense gradient group dp x cp, cp inner
            "coords": {"tp": mesh.tp_rank, "dp": mesh.dp_rank * mesh.cp_size + mesh.cp_rank},
            "memory_within_3pct": all(abs(mine[k] - theory[k]) <= TOLERANCE * theory[k] for k in theory),
            "traffic": traffic, "fsdp_axes": sorted({shard_axis, replica_axis}), "fsdp_traffic": got, "fsdp_traffic_formula": formula,
            "traffic_matches_formula": all(got.get(k, 0) == v for k, v in formula.items()) and
            all(v == 0 for k, v in got.items() if k not in formula), "loss": losses}


def _worker(rank: int, world: int, args, out_file: str) -> None:
    config = make_config(args.tiny)
    for name in args.layouts:
        record = _measure(name, parse_layout(name, world), config, args.batch, args.seq)
        ranks = [None] * world
        dist.all_gather_object(ranks, record)
        if rank == 0:
            with open(out_file, "a") as f:
                f.write(json.dumps({"layout": name, "ranks": ranks}) + "\n")


def planner_predictions(run: dict, world: int, batch: int, seq: int, tiny: bool) -> None:
    """Add the planner's prediction for every rank of `run` (meshboost.plan, from the config alone):
    its weights, gradients and AdamW moments (`rank_state`) and its FSDP2 traffic per axis (`rank_comm`:
    dp's all-gathers and reduce-scatters, dp_replicate's all-reduce), and whether each equals the
    measurement exactly (the planner models FSDP2's padding rows and units, so no tolerance is needed)."""
    from meshboost.plan import Planner
    from meshboost.plan.layout import Layout

    kw = parse_layout(run["layout"], world)
    sp = kw.get("sp_size", 1)
    dp = world // (kw["tp_size"] * sp)
    layout = Layout(tp=kw["tp_size"], sp=sp, dp=dp, dp_replicate=kw["dp_replicate_size"], zero=3, precision="fp32",
                    microbatches=1, microbatch_size=batch)
    planner = Planner(make_config(tiny), gpus=world, seq=seq, global_batch=batch * dp, precision="fp32", device="cpu")
    planner.check(layout)
    for r in run["ranks"]:
        state = planner.rank_state(layout, 0, r["coords"]["tp"], r["coords"]["dp"])
        comm = planner.rank_comm(layout, 0, r["coords"]["tp"])
        traffic = {op: sum(n for o, n in comm["dp"] if o == op) for op in ("all_gather", "reduce_scatter")}
        if layout.dp_replicate > 1:
            traffic["all_reduce_replicas"] = sum(n for _, n in comm["dp_replicate"])
        r["planner_memory"] = {k: state[k] for k in r["memory"]}
        r["planner_traffic"] = traffic
        r["planner_equals_measured"] = r["planner_memory"] == r["memory"] and all(
            r["fsdp_traffic"].get(k, 0) == v for k, v in traffic.items())


def format_table(runs: list[dict]) -> str:
    head = ("layout", "rank", "weights B (theory) [planner]", "grads B (theory) [planner]",
            "states B (theory) [planner]", "<=3%", "all-gather B (formula) [planner]",
            "reduce-scatter B (formula) [planner]", "replica all-reduce B (formula) [planner]", "eq", "planner eq",
            "other axes")
    rows = [head]
    for run in runs:
        for r in run["ranks"]:
            m, t, g, f = r["memory"], r["memory_theory"], r["fsdp_traffic"], r["fsdp_traffic_formula"]
            pm, pt = r["planner_memory"], r["planner_traffic"]
            other = {k: v for k, v in r["traffic"].items() if k not in r["fsdp_axes"]}
            rows.append((run["layout"], str(r["rank"]), *(f"{m[k]} ({t[k]:.0f}) [{pm[k]}]" for k in m),
                         "yes" if r["memory_within_3pct"] else "NO",
                         *(f"{g.get(k, 0)} ({f.get(k, '-')}) [{pt.get(k, '-')}]"
                           for k in ("all_gather", "reduce_scatter", "all_reduce_replicas")),
                         "yes" if r["traffic_matches_formula"] else "NO",
                         "yes" if r["planner_equals_measured"] else "NO",
                         " ".join(f"{k}:{sum(v.values())}" for k, v in sorted(other.items())) or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    return "\n".join("  ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in rows)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=4, help="processes (one spawn)")
    p.add_argument("--layouts", nargs="+", default=["dp4", "hsdp2x2", "tp2dp2", "tp2rep2", "sp2rep2"])
    p.add_argument("--batch", type=int, default=2, help="local batch (per dp rank)")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 128 (the suite's size)")
    args = p.parse_args(argv)
    for name in args.layouts:
        try:
            parse_layout(name, args.world)
        except ValueError as e:
            p.error(str(e))
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from meshboost.testing import spawn
    with tempfile.TemporaryDirectory() as root:
        out_file = os.path.join(root, "zero3_memory.jsonl")
        spawn(_worker, args.world, args, out_file)
        with open(out_file) as f:
            runs = [json.loads(line) for line in f]
    for run in runs:
        run["memory_within_3pct"] = all(r["memory_within_3pct"] for r in run["ranks"])
        run["traffic_matches_formula"] = all(r["traffic_matches_formula"] for r in run["ranks"])
        planner_predictions(run, args.world, args.batch, args.seq, args.tiny)
        run["planner_equals_measured"] = all(r["planner_equals_measured"] for r in run["ranks"])
    c = make_config(args.tiny)
    print(f"Llama: {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, "
          f"{runs[0]['ranks'][0]['params']} parameters; fp32, AdamW, world {args.world}, batch {args.batch} x seq "
          f"{args.seq} per dp rank; memory after the second step's backward, traffic of that whole step (payload bytes)")
    print(format_table(runs))
    for run in runs:
        print("JSON " + json.dumps({k: v for k, v in run.items()}))
    return runs


if __name__ == "__main__":
    main()
