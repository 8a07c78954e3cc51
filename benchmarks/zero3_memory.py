"""ZeRO-3 and HSDP: per-rank weights, gradients and optimizer states, and the bytes each mesh axis carries
in one training step, measured against the formulas, for a small Llama (a tiny Qwen3-MoE for the
expert-parallel layouts) trained through the Booster with `HybridParallelPlugin(zero_stage=3, tp_size=...,
pp_size=..., dp_replicate_size=...)` or `MoeHybridParallelPlugin(ep_size=..., ...)` (FSDP2), fp32, on one spawn:

    python benchmarks/zero3_memory.py [--world 4] [--layouts dp4 hsdp2x2 tp2dp2 tp2rep2 sp2rep2 pp2dp2 pp2rep2
                                                             ep2dp4 ep2rep2] [--tiny]

A layout name reads: dpN (ZeRO-3 over N ranks), hsdpRxS (R replica groups of S shard ranks), tpT..,
spC.. (Ulysses context parallelism), ppS.. (S pipeline stages, 1F1B, 2 micro-batches per step), epE..
(experts split over E of the dp ranks), repR (dp_replicate_size R); world = tp x sp x pp x dp.

- Memory, per rank (`meshboost.optim.memory.memory_breakdown` after a backward, the moments from the
  step before): weights = gradients = 4 x (D / (dp_shard x tp) + E / (ep x edp_shard x tp)), AdamW's two
  moments twice that, where D and E are the dense and expert parameters of the rank's pipeline stage,
  unsharded (the whole model's tensors of the names the stage the plugin built holds: the stage's own
  count, not P / pp), dp_shard the ranks of one replica group (times sp: FSDP2 shards over dp_shard x cp)
  and edp_shard = dp_shard / ep the ranks of one replica group holding the same experts. The expert and
  dense shares are checked apart too (the rank's FSDP2 shards by kind). Tensor parallelism leaves the
  norms whole on every tp rank and FSDP2 pads a dim it cannot split evenly, so each rank must be within 3%.
- Traffic, per rank and axis, of one step (forward, backward, optimizer step) under
  `meshboost.distributed.profiling.dispatched_comm_counter` (every collective reaching torch's
  dispatcher, FSDP2's included), payload bytes (the full tensor of each collective). FSDP2 makes one
  unit per transformer layer (and per experts module) plus the root (embeddings, final norm, LM head);
  U_i is unit i's tp-local parameter bytes, padded to a multiple of its shard group's ranks (dense:
  dp_shard, experts: edp_shard), each unit counted on its own group:
      all-gather over the shard axis:      sum_i U_i in forward, again for every non-root unit in backward
                                            (ZeRO-3 frees gathered weights after forward; the root keeps them);
                                            under pp once per step (the plugin's reshard_after_forward
                                            default is False there: the stage stays gathered for all the
                                            micro-batches), and no more for 2 micro-batches than for 1
      reduce-scatter over the shard axis:  sum_i U_i, once per unit per step (pp: after the last micro-batch)
      all-reduce over dp_replicate:        sum_i U_i / shard (each replica group's reduced shard; experts too)
  Under ep without pp the dense all-gathers also hold refuse_empty_batch's int32 per dp rank over dp
  (4 x dp bytes per forward), which the planner files with dp's; the dense columns sum dp's group with
  the dense shard group for that reason. The other collectives (tp's activations, ep's all-to-alls, the
  pipeline's sends, the 4-byte labelled-token count over dp) are printed as measured, without a formula
  here (docs/benchmarks.md, tp section, has tp's).

- The planner's prediction (`meshboost.plan`, from the config alone: `Planner.rank_state` and
  `rank_comm` for the rank's pp, tp and dp coordinates) is printed in [brackets] beside each measured
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
LAYOUT = re.compile(r"^(?:tp(?P<tp>\d+))?(?:sp(?P<sp>\d+))?(?:pp(?P<pp>\d+))?(?:ep(?P<ep>\d+))?"
                    r"(?:dp(?P<dp>\d+)|hsdp(?P<r>\d+)x(?P<s>\d+)|rep(?P<rep>\d+))?$")
TRAFFIC_KEYS = ("dense_all_gather", "dense_reduce_scatter", "expert_all_gather", "expert_reduce_scatter",
                "all_reduce_replicas")
MICROBATCHES = 2                    # a pipeline layout's micro-batches per step (1F1B)


def parse_layout(name: str, world: int) -> dict:
    """Plugin keywords of a layout name (see the module docstring); raises naming the name."""
    m = LAYOUT.match(name)
    if not m or not name:
        raise ValueError(f"layout {name!r}: expected e.g. dp4, hsdp2x2, tp2dp2, tp2rep2, sp2rep2, pp2dp2, ep2dp4")
    tp, sp, pp, ep = (int(m[k] or 1) for k in ("tp", "sp", "pp", "ep"))
    replicas = int(m["r"] or m["rep"] or 1)
    dp = int(m["dp"]) if m["dp"] else int(m["r"]) * int(m["s"]) if m["r"] else world // (tp * sp * pp)
    if tp * sp * pp * dp != world:
        raise ValueError(f"layout {name!r}: tp {tp} x sp {sp} x pp {pp} x dp {dp} != --world {world}")
    kwargs = dict(tp_size=tp, pp_size=pp, zero_stage=3, dp_replicate_size=replicas)
    if pp > 1:
        kwargs["num_microbatches"] = MICROBATCHES
    if ep > 1:
        kwargs["ep_size"] = ep
    if sp > 1:
        kwargs.update(sp_size=sp, enable_sequence_parallelism=True, sequence_parallelism_mode="all_to_all")
    return kwargs


def make_config(tiny: bool, moe: bool = False):
    """A Llama whose dims divide every layout's split (no vocab padding, every kv head split over tp); with
    `moe`, meshboost.testing.moe's Qwen3-MoE (4 experts of 2 active in every layer; the tests' size at --tiny)."""
    import transformers
    if moe:
        from meshboost.testing.moe import moe_config
        return moe_config("qwen3_moe") if tiny else moe_config(
            "qwen3_moe", hidden_size=256, num_hidden_layers=4, vocab_size=1024, moe_intermediate_size=128,
            head_dim=64, max_position_embeddings=256)
    hidden, layers, vocab = (64, 2, 128) if tiny else (256, 4, 1024)
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=layers,
                                    max_position_embeddings=256, tie_word_embeddings=False)


def _is_expert(p) -> bool:
    # by the runtime's own record (the weight split over ep), not by a name pattern
    from meshboost.distributed.param_info import get_tp_info
    info = get_tp_info(p)
    return info is not None and info.expert_size > 1


def _units(model) -> list[tuple[bool, list]]:
    """(is the root, its own parameters) for every FSDP2 unit: a unit's parameters minus its sub-units'."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    inner = {id(p): u for u in units for p in u.parameters()}       # the innermost unit wins: modules() is pre-order
    return [(u is model, [p for p in u.parameters() if inner[id(p)] is u]) for u in units]


def _role(p) -> str:
    return "expert" if _is_expert(p) else "dense"


def traffic_formula(model, once: bool, empty_check: int = 0) -> dict:
    """Payload bytes by (role, op) of one step (the module docstring's formula); role "dense" / "expert"
    (each over its own shard axis, the parameter's FSDP2 mesh's last dim) or "replicas" (its first, HSDP).
    `once`: a pipeline stage, gathered once per step (reshard_after_forward False). `empty_check`: the
    bytes of refuse_empty_batch's all-gather over dp (ep without pp), filed with the dense all-gathers."""
    out: dict = {"dense_all_gather": empty_check} if empty_check else {}
    for root, params in _units(model):
        mesh = params[0].device_mesh
        shard, replicas = mesh.size(mesh.ndim - 1), mesh.size(0) if mesh.ndim == 2 else 1
        size = sum(-(-p.shape[0] // shard) * shard * (p.numel() // p.shape[0]) * FP32 for p in params)
        role = _role(params[0])
        if shard > 1:
            out[f"{role}_all_gather"] = out.get(f"{role}_all_gather", 0) + size * (1 if root or once else 2)
            out[f"{role}_reduce_scatter"] = out.get(f"{role}_reduce_scatter", 0) + size
        if replicas > 1:
            out["all_reduce_replicas"] = out.get("all_reduce_replicas", 0) + size // shard
    return out


def _fsdp_traffic(model, counter, dp_group) -> tuple[dict, set]:
    # returns ({formula key: bytes}, {(group label, op)} those bytes came from)
    """Measured payload bytes by the formula's keys: each role's collectives summed over the distinct labels
    of its groups (a group by object, so a size-1 axis naming two axes one group counts once); the dense
    ones over dp's group too (under ep it carries refuse_empty_batch's all-gather, the planner's "dp")."""
    traffic = {k: v["bytes_by_op"] for k, v in counter.summary().items()}
    labels: dict = {"dense": {counter.label(dp_group)}}
    for _, params in _units(model):
        mesh = params[0].device_mesh
        labels.setdefault(_role(params[0]), set()).add(counter.label(mesh.get_group(mesh.ndim - 1)))
        if mesh.ndim == 2:
            labels.setdefault("replicas", set()).add(counter.label(mesh.get_group(0)))
    got, counted = {}, set()
    for role, names in labels.items():
        for op in ("all_reduce",) if role == "replicas" else ("all_gather", "reduce_scatter"):
            key = "all_reduce_replicas" if role == "replicas" else f"{role}_{op}"
            got[key] = sum(traffic.get(n, {}).get(op, 0) for n in names)
            counted |= {(n, op) for n in names}
    return got, counted


def _stage_counts(model, whole: dict) -> tuple[int, int]:
    """(dense, expert) parameters of this rank's pipeline stage, unsharded: the whole model's tensors of the
    names the stage holds (the pipeline keeps HF's names)."""
    counts = [0, 0]
    for n, p in model.named_parameters():
        counts[_is_expert(p)] += whole[n]
    return counts[0], counts[1]


def _step(booster, model, opt, ids, pipeline: bool, memory_breakdown) -> tuple[dict, float | None]:
    """One training step (the optimizer's included); the memory after its backward and its loss."""
    if pipeline:
        out = booster.execute_pipeline(iter([{"input_ids": ids, "labels": ids}]), model, lambda o, _: o.loss, opt)
        loss = out["loss"]
    else:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, opt)
    memory = memory_breakdown(model.unwrap(), opt)
    opt.step(), opt.zero_grad()
    return memory, None if loss is None else loss.item()


def _measure(name: str, kwargs: dict, config, batch: int, seq: int) -> dict:
    """One layout: two steps, the second measured (memory after its backward, traffic of all of it)."""
    import transformers

    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin, MoeHybridParallelPlugin
    from meshboost.distributed.profiling import dispatched_comm_counter
    from meshboost.optim.memory import memory_breakdown

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    whole = {n: p.numel() for n, p in model.named_parameters()}
    params = sum(whole.values())
    plugin = (MoeHybridParallelPlugin if "ep_size" in kwargs else HybridParallelPlugin)(**kwargs)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    mesh, pipeline = plugin.mesh, kwargs["pp_size"] > 1
    dense, experts = _stage_counts(model.unwrap(), whole)
    gen = torch.Generator().manual_seed(mesh.dp_rank)
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
    losses = []
    for step in range(2):           # the first makes AdamW's moments; the second is measured
        with dispatched_comm_counter(mesh) if step == 1 else contextlib.nullcontext() as counter:
            memory, loss = _step(booster, model, opt, ids, pipeline, memory_breakdown)
        losses.append(loss)
    traffic = {k: v["bytes_by_op"] for k, v in counter.summary().items()}
    got, counted = _fsdp_traffic(model.unwrap(), counter, mesh.group("dp"))
    empty_check = 4 * mesh.dp_size if mesh.ep_size > 1 and not pipeline and mesh.dp_size > 1 else 0
    formula = traffic_formula(model.unwrap(), once=pipeline, empty_check=empty_check)
    dims, tp = mesh.dims, mesh.tp_size
    # dense over dp_shard (x cp), experts over edp_shard (x cp), both inside each tp (and ep) rank
    roles = {"dense": dense / (dims.dp_shard * mesh.cp_size * tp),
             "expert": experts / (dims.ep * dims.edp_shard * mesh.cp_size * tp)}
    share = sum(roles.values())
    theory = {"weights": FP32 * share, "gradients": FP32 * share, "optimizer_states": 2 * FP32 * share}
    mine = {"weights": memory["working_weights"], "gradients": memory["gradients"],
            "optimizer_states": memory["optimizer_states"]}
    by_role = {"dense": 0, "expert": 0}       # this rank's weights by kind: its FSDP2 shards, padding excluded
    for p in model.unwrap().parameters():
        by_role[_role(p)] += FP32 * p.to_local().numel()
    role_theory = {k: FP32 * v for k, v in roles.items()}
    return {"layout": name, "rank": dist.get_rank(), "params": params, "stage_params": dense + experts,
            "expert_params": experts, "dp_shard": dims.dp_shard, "replicas": dims.dp_replicate, "tp": tp,
            "memory": mine, "memory_theory": theory,
            # the planner's (pp, tp, dp rank): its dp ranks index the dense gradient group dp x cp, cp inner
            "coords": {"pp": mesh.pp_rank, "tp": mesh.tp_rank, "dp": mesh.dp_rank * mesh.cp_size + mesh.cp_rank},
            "weights_by_role": by_role, "weights_by_role_theory": role_theory,
            "memory_within_3pct": all(abs(mine[k] - theory[k]) <= TOLERANCE * theory[k] for k in theory) and
            all(abs(by_role[k] - role_theory[k]) <= TOLERANCE * role_theory[k] for k in by_role),
            "traffic": traffic, "counted": sorted(counted), "fsdp_traffic": got, "fsdp_traffic_formula": formula,
            "traffic_matches_formula": all(got.get(k, 0) == v for k, v in formula.items()) and
            all(v == 0 for k, v in got.items() if k not in formula), "loss": losses}


def _is_moe(name: str) -> bool:
    """An expert-parallel layout name: measured on the Qwen3-MoE (the names passed parse_layout already)."""
    return int(LAYOUT.match(name)["ep"] or 1) > 1


def _worker(rank: int, world: int, args, out_file: str) -> None:
    for name in args.layouts:
        config = make_config(args.tiny, _is_moe(name))
        record = _measure(name, parse_layout(name, world), config, args.batch, args.seq)
        ranks = [None] * world
        dist.all_gather_object(ranks, record)
        if rank == 0:
            with open(out_file, "a") as f:
                f.write(json.dumps({"layout": name, "ranks": ranks}) + "\n")


def planner_predictions(run: dict, world: int, batch: int, seq: int, tiny: bool) -> None:
    """Add the planner's prediction for every rank of `run` (meshboost.plan, from the config alone):
    its weights, gradients and AdamW moments (`rank_state`) and its FSDP2 traffic per axis (`rank_comm`:
    dp's and edp's all-gathers and reduce-scatters, dp_replicate's all-reduce), and whether each equals
    the measurement exactly (the planner models FSDP2's padding rows and units, so no tolerance is needed)."""
    from meshboost.plan import Planner
    from meshboost.plan.layout import Layout

    kw = parse_layout(run["layout"], world)
    sp, pp = kw.get("sp_size", 1), kw["pp_size"]
    dp = world // (kw["tp_size"] * sp * pp)
    micro = MICROBATCHES if pp > 1 else 1
    layout = Layout.of(tp=kw["tp_size"], pp=pp, cp=sp, dp=dp, ep=kw.get("ep_size", 1),
                       dp_replicate=kw["dp_replicate_size"], zero=3, precision="fp32", microbatches=micro,
                       microbatch_size=batch // micro)
    planner = Planner(make_config(tiny, _is_moe(run["layout"])), gpus=world, seq=seq, global_batch=batch * dp,
                      precision="fp32", device="cpu")
    planner.check(layout)
    axes = {"dp": "dense", "edp": "expert"}
    for r in run["ranks"]:
        c = r["coords"]
        state = planner.rank_state(layout, c["pp"], c["tp"], c["dp"])
        comm = planner.rank_comm(layout, c["pp"], c["tp"])
        traffic = {f"{role}_{op}": sum(n for o, n in comm.get(axis, ()) if o == op)
                   for axis, role in axes.items() if axis in comm for op in ("all_gather", "reduce_scatter")}
        if layout.dp_replicate > 1:
            traffic["all_reduce_replicas"] = sum(n for _, n in comm["dp_replicate"])
        r["planner_memory"] = {k: state[k] for k in r["memory"]}
        r["planner_traffic"] = traffic
        r["planner_equals_measured"] = r["planner_memory"] == r["memory"] and all(
            r["fsdp_traffic"].get(k, 0) == traffic.get(k, 0) for k in {*traffic, *r["fsdp_traffic"]})


def format_table(runs: list[dict]) -> str:
    head = ("layout", "rank", "weights B (theory) [planner]", "grads B (theory) [planner]",
            "states B (theory) [planner]", "expert|dense weights B (theory)", "<=3%",
            "all-gather B (formula) [planner]", "reduce-scatter B (formula) [planner]",
            "expert all-gather B (formula) [planner]", "expert reduce-scatter B (formula) [planner]",
            "replica all-reduce B (formula) [planner]", "eq", "planner eq", "other axes")
    rows = [head]
    for run in runs:
        for r in run["ranks"]:
            m, t, g, f = r["memory"], r["memory_theory"], r["fsdp_traffic"], r["fsdp_traffic_formula"]
            pm, pt = r["planner_memory"], r["planner_traffic"]
            counted = {tuple(c) for c in r["counted"]}
            other = {k: {op: n for op, n in v.items() if (k, op) not in counted} for k, v in r["traffic"].items()}
            other = {k: v for k, v in other.items() if v}
            w, wt = r["weights_by_role"], r["weights_by_role_theory"]
            rows.append((run["layout"], str(r["rank"]), *(f"{m[k]} ({t[k]:.0f}) [{pm[k]}]" for k in m),
                         f"{w['expert']}|{w['dense']} ({wt['expert']:.0f}|{wt['dense']:.0f})",
                         "yes" if r["memory_within_3pct"] else "NO",
                         *(f"{g.get(k, 0)} ({f.get(k, '-')}) [{pt.get(k, '-')}]" for k in TRAFFIC_KEYS),
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
    for moe in sorted({_is_moe(run["layout"]) for run in runs}):
        c = make_config(args.tiny, moe)
        params = next(r["ranks"][0]["params"] for r in runs if _is_moe(r["layout"]) == moe)
        print(f"{type(c).__name__[:-len('Config')]}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, vocab "
              f"{c.vocab_size}, {params} parameters")
    print(f"fp32, AdamW, world {args.world}, batch {args.batch} x seq {args.seq} per dp rank; memory after the second "
          "step's backward, traffic of that whole step (payload bytes)")
    print(format_table(runs))
    for run in runs:
        print("JSON " + json.dumps({k: v for k, v in run.items()}))
    return runs


if __name__ == "__main__":
    main()
