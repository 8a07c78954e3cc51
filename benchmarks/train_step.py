"""Training-step benchmark: step time, communication per group and memory per rank for plain
PyTorch, meshboost (tp=1, tp=2, tp=2 x dp=2 with DDP and with ZeRO-1) and PyTorch DTensor tp=2,
on the same HF model, weights and data, in one command.

    python benchmarks/train_step.py --model gpt2 --layers 4 --hidden 256 --seq 128 --batch 8

The launcher spawns one process group per world size (1, 2, 4 processes); configurations of one
world size run in the same processes, interleaved step by step (harness.py). It prints a table and
one JSON line per configuration (prefix "JSON "). Ratios: step time against plain PyTorch and
against DTensor from the same run; communication measured / Megatron theory (theory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")      # before transformers loads; inherited by workers

import torch.multiprocessing as mp

from benchmarks.models import FAMILIES, ModelSpec
from benchmarks.runners import CONFIGS
from benchmarks.theory import dp_comm_theory, memory_theory, tp_comm_theory
from meshboost.testing.spawn import free_port

DEFAULT_CONFIGS = "plain,tp1,tp2,dtensor,plain2,dp2,zero1"
LEGEND = """\
step/fwd+bwd/optim ms: median over timed steps of the slowest rank; cpu ms: CPU time of the busiest rank (the work,
  whatever the scheduler granted). x plain, x DTensor: step-time ratio (< 1 is faster);
  only pairs sharing processes are interleaved step by step (plain<->tp=1, tp=2<->DTensor, dp=2<->ZeRO-1): trust
  those. meshboost and DTensor use the same transport (gloo on CPU, NCCL on CUDA): tp=2 / DTensor is like for like.
tp calls / MB / meas/theory: forward+backward, rank 0, ring bytes sent; theory = Megatron (benchmarks/theory.py).
dp: gradient reduction (DDP hook in backward, ZeRO in the step). step comm: collectives of the optimizer step.
wire/ring: bytes this rank really wrote to its sockets / ring bytes counted (about 1 on gloo; 0 on NCCL's GPU links).
(!): a collective bypassed record_collective
  (the dispatcher witness saw more; JSON witness_*). Memory: max over ranks; weights and grads after backward,
  masters and optimizer states after the step."""
MB = 2 ** 20


def run_configs(spec: ModelSpec, keys: list[str], warmup: int = 3, steps: int = 10, threads: int = 1) -> list[dict]:
    """Run every configuration in `keys`, one process group per world size; returns one merged
    record per configuration (in `keys` order)."""
    return run_models([spec], keys, warmup, steps, threads)[0]


def run_models(specs: list[ModelSpec], keys: list[str], warmup: int = 3, steps: int = 10,
               threads: int = 1) -> list[list[dict]]:
    """`run_configs` for several models with one process group per world size (the models in turn in
    the same processes); one list of records per model."""
    by_world: dict[int, list[str]] = {}
    for key in keys:
        if key not in CONFIGS:
            raise ValueError(f"--configs: unknown {key!r}; expected some of {sorted(CONFIGS)}")
        by_world.setdefault(CONFIGS[key].world, []).append(key)
    per_rank: list[dict[str, list[dict]]] = [{} for _ in specs]
    from benchmarks.harness import worker
    with tempfile.TemporaryDirectory() as outdir:
        for world, group_keys in sorted(by_world.items()):
            mp.start_processes(worker, args=(world, free_port(), group_keys, [s.as_dict() for s in specs],
                                             max(warmup, 1), steps, threads, outdir),
                               nprocs=world, join=True, start_method="spawn")
            for index in range(len(specs)):
                for rank in range(world):
                    with open(os.path.join(outdir, f"spec{index}_world{world}_rank{rank}.json")) as f:
                        for key, result in json.load(f).items():
                            per_rank[index].setdefault(key, []).append(result)
    out = []
    for spec, results in zip(specs, per_rank):
        records = [merge(spec, CONFIGS[key], results[key]) for key in keys]
        add_ratios(records)
        out.append(records)
    return out


def _group_total(summary: dict | None, group: str) -> dict:
    g = (summary or {}).get(group, {})
    return {"calls": g.get("calls", 0), "payload_bytes": g.get("payload_bytes", 0),
            "sent_bytes": g.get("sent_bytes", 0.0), "by_op": g.get("by_op", {})}


def merge_summaries(*summaries: dict | None) -> dict:
    """Sum per-group counter summaries (e.g. the forward+backward and optimizer-step phases)."""
    out: dict = {}
    for summary in summaries:
        for group, g in (summary or {}).items():
            acc = out.setdefault(group, {"calls": 0, "payload_bytes": 0, "sent_bytes": 0.0, "by_op": {},
                                         "bytes_by_op": {}})
            for k in ("calls", "payload_bytes", "sent_bytes"):
                acc[k] += g[k]
            for k in ("by_op", "bytes_by_op"):
                for op, v in g.get(k, {}).items():
                    acc[k][op] = acc[k].get(op, 0) + v
    return out


def merge(spec: ModelSpec, config, ranks: list[dict]) -> dict:
    """One configuration's record from its ranks' results."""
    record = {"config": config.label, "key": config.key, "model": spec.as_dict(), "world": config.world,
              "tp": config.tp, "dp": config.dp, "zero_stage": config.zero_stage}
    ranks = ranks[:1] if config.solo else ranks          # the idle ranks of a solo configuration did nothing
    if "skipped" in ranks[0]:
        return record | {"skipped": ranks[0]["skipped"]}
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    fwd_bwd = [max(r["fwd_bwd_s"][i] for r in ranks) for i in range(len(ranks[0]["fwd_bwd_s"]))]
    cpu = [max(r["cpu_s"][i] for r in ranks) for i in range(len(ranks[0]["cpu_s"]))]
    blocked = [max(r["blocked_s"][i] for r in ranks) for i in range(len(steps))]
    overlapped = [max(r["overlapped_s"][i] for r in ranks) for i in range(len(steps))]
    dispatched = [r["dispatched_wait"] for r in ranks if r.get("dispatched_wait")]
    median = statistics.median(steps)
    first = ranks[0]
    # Rank 0's view (every rank of these symmetric configurations sends the same). meshboost rows are
    # read from record_collective; DTensor rows from the dispatcher witness (the only counter they feed).
    source = "record_collective" if first["fwd_bwd"]["comm"] is not None else "dispatcher"
    phase = {name: first[name]["comm"] if source == "record_collective" else first[name]["witness"]
             for name in ("fwd_bwd", "step")}
    witness = {name: first[name]["witness"] for name in ("fwd_bwd", "step")}
    comm = merge_summaries(phase["fwd_bwd"], phase["step"])
    memory = {k: max(r["memory"][k] for r in ranks) for k in first["memory"]}
    tp_theory = tp_comm_theory(spec, config.tp, config.dp)
    tp_meas = _group_total(phase["fwd_bwd"], "tp")          # the Megatron formula covers forward+backward
    dp_meas = _group_total(comm, "dp")
    dp_theory = dp_comm_theory(memory["weights"], config.dp)     # every parameter is trained: grads = weights
    num_params = _num_params(spec)
    mem_theory = memory_theory(num_params, config.tp, config.dp, config.zero_stage)
    wire = first["fwd_bwd"]["wire_bytes"], first["step"]["wire_bytes"]
    ring = sum(g["sent_bytes"] for g in merge_summaries(witness["fwd_bwd"], witness["step"]).values())
    record |= {
        "skipped": None,
        "step_ms_median": 1e3 * median, "step_ms_min": 1e3 * min(steps), "step_ms_max": 1e3 * max(steps),
        "fwd_bwd_ms_median": 1e3 * statistics.median(fwd_bwd),
        "optimizer_ms_median": 1e3 * statistics.median(s - f for s, f in zip(steps, fwd_bwd)),
        "cpu_ms_median": 1e3 * statistics.median(cpu),
        "cpu_ms_all_ranks_median": 1e3 * statistics.median(sum(r["cpu_s"][i] for r in ranks) for i in range(len(cpu))),
        "steps_timed": len(steps), "step_ms_all": [1e3 * t for t in steps],
        "tokens_per_s": spec.batch * spec.seq / median,
        "loss0": statistics.mean(r["loss0"] for r in ranks),
        "comm_source": source, "comm": comm, "comm_fwd_bwd": phase["fwd_bwd"], "comm_step": phase["step"],
        "witness_fwd_bwd": witness["fwd_bwd"], "witness_step": witness["step"],
        # seconds per step in collectives, slowest rank: meshboost's timer in the timed steps; for DTensor the
        # dispatcher's clock in one untimed step (its timer sees no meshboost collective)
        "wait_blocked_ms_median": 1e3 * (max(d["blocked_s"] for d in dispatched) if dispatched
                                         else statistics.median(blocked)),
        "wait_overlapped_ms_median": 1e3 * (max(d["overlapped_s"] for d in dispatched) if dispatched
                                            else statistics.median(overlapped)),
        "wait_source": "dispatcher (one untimed step)" if dispatched else "comm.py (timed steps)",
        "witness_calls": sum(g["calls"] for g in merge_summaries(witness["fwd_bwd"], witness["step"]).values()),
        "witness_agrees": source == "dispatcher" or all(_agree(phase[n], witness[n]) for n in phase),
        "wire_bytes_rank0": None if None in wire else sum(wire),
        "wire_over_ring": sum(wire) / ring if None not in wire and ring else None,
        "tp_theory": tp_theory, "tp_calls_fwd_bwd": tp_meas["calls"], "tp_sent_bytes_fwd_bwd": tp_meas["sent_bytes"],
        "tp_calls_ratio": _ratio(tp_meas["calls"], tp_theory["calls"]),
        "tp_bytes_ratio": _ratio(tp_meas["sent_bytes"], tp_theory["sent_bytes"]),
        "dp_theory": dp_theory, "dp_bytes_ratio": _ratio(dp_meas["sent_bytes"], dp_theory["sent_bytes"]),
        "memory": memory, "memory_theory": mem_theory, "num_params": num_params,
        "memory_ratio": {k: _ratio(memory[k], mem_theory[k]) for k in memory},
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
    }
    return record


def _agree(counted: dict, witness: dict) -> bool:
    keys = set(counted) | set(witness)
    return all(_group_total(counted, k)["calls"] == _group_total(witness, k)["calls"] and
               _group_total(counted, k)["payload_bytes"] == _group_total(witness, k)["payload_bytes"] for k in keys)


def _ratio(a, b):
    return a / b if b else None      # nothing expected: no ratio (a nonzero `a` shows in the absolute columns)


_PARAM_CACHE: dict = {}


def _num_params(spec: ModelSpec) -> int:
    key = tuple(sorted(spec.as_dict().items()))
    if key not in _PARAM_CACHE:
        from benchmarks.models import build_model
        _PARAM_CACHE[key] = sum(p.numel() for p in build_model(spec).parameters())
    return _PARAM_CACHE[key]


def add_ratios(records: list[dict]) -> None:
    """Step time against plain PyTorch and DTensor of the same run (None when absent). When both
    ran in the same processes (interleaved), the ratio is the median of per-round ratios, which
    cancels slow drifts in machine load; otherwise the ratio of medians."""
    ref = {r["key"]: r for r in records if not r.get("skipped")}
    for r in records:
        if r.get("skipped"):
            continue
        # plain PyTorch placed in this row's own process group (plain2 beside tp=2) pairs step by step
        plain = "plain2" if "plain2" in ref and ref["plain2"]["world"] == r["world"] and r["key"] != "plain2" \
            else "plain"
        for name, key in (("vs_plain", plain), ("vs_dtensor", "dtensor")):
            other = ref.get(key)
            if other is None:
                r[name] = None
            elif other["world"] == r["world"] and len(other["step_ms_all"]) == len(r["step_ms_all"]):
                r[name] = statistics.median(a / b for a, b in zip(r["step_ms_all"], other["step_ms_all"]))
            else:
                r[name] = r["step_ms_median"] / other["step_ms_median"]
            r[name + "_paired"] = other is not None and other["world"] == r["world"]


# -- reporting --------------------------------------------------------------------------------
def _f(value, fmt="{:.2f}"):
    return "-" if value is None else fmt.format(value)


def format_summary(records: list[dict]) -> str:
    """The step-time ratios the targets name, each from configurations paired step by step where the
    run has them, and each row's time in collectives."""
    by_key = {r["key"]: r for r in records if not r.get("skipped")}
    lines = []
    for key, name in (("tp2", "vs_dtensor"), ("tp2", "vs_plain"), ("tp1", "vs_plain")):
        r = by_key.get(key)
        if r is not None and r.get(name) is not None:
            other = "DTensor tp=2" if name == "vs_dtensor" else \
                ("plain (same group)" if "plain2" in by_key and key != "tp1" else "plain")
            lines.append(f"  {r['config']} / {other}: {r[name]:.3f}"
                         f"{'' if r[name + '_paired'] else ' (not paired: ratio of medians)'}")
    for r in by_key.values():
        lines.append(f"  {r['config']}: collectives per step, blocked {r['wait_blocked_ms_median']:.1f} ms (exposed), "
                     f"async in flight behind compute {r['wait_overlapped_ms_median']:.1f} ms [{r['wait_source']}]")
    return "summary:\n" + "\n".join(lines)


def format_table(records: list[dict]) -> str:
    head = ("config", "step ms", "fwd+bwd ms", "optim ms", "cpu ms", "x plain", "x DTensor", "tok/s", "tp calls",
            "tp MB/rank", "tp meas/theory",
            "dp calls", "dp MB/rank", "dp meas/theory", "step comm", "wire/ring", "weights MB", "grads MB",
            "masters MB", "optim MB", "peak RSS MB", "loss0")
    rows = [head]
    for r in records:
        if r.get("skipped"):
            rows.append((r["config"], f"skipped: {r['skipped']}") + ("",) * (len(head) - 2))
            continue
        tp, dp, mem = _group_total(r["comm_fwd_bwd"], "tp"), _group_total(r["comm"], "dp"), r["memory"]
        step = r["comm_step"]
        step_comm = " ".join(f"{g}:{v['calls']}x/{v['payload_bytes']}B" for g, v in step.items()) or "none"
        rows.append((
            r["config"] + ("" if r["witness_agrees"] else " (!)"), _f(r["step_ms_median"], "{:.1f}"),
            _f(r["fwd_bwd_ms_median"], "{:.1f}"), _f(r["optimizer_ms_median"], "{:.1f}"),
            _f(r["cpu_ms_median"], "{:.1f}"),
            _f(r["vs_plain"]), _f(r["vs_dtensor"]), _f(r["tokens_per_s"], "{:.0f}"),
            str(tp["calls"]), _f(tp["sent_bytes"] / MB, "{:.3f}"),
            f"{_f(r['tp_bytes_ratio'], '{:.4f}')} ({tp['calls']}/{r['tp_theory']['calls']} calls)",
            str(dp["calls"]), _f(dp["sent_bytes"] / MB, "{:.3f}"), _f(r["dp_bytes_ratio"], "{:.4f}"),
            step_comm, _f(r["wire_over_ring"], "{:.3f}"),
            _f(mem["weights"] / MB), _f(mem["grads"] / MB), _f(mem["masters"] / MB),
            _f(mem["optimizer_states"] / MB), _f(r["peak_rss_mb"], "{:.0f}"), _f(r["loss0"], "{:.5f}")))
    widths = [max(len(str(row[i])) for row in rows if len(row) > i and not str(row[1]).startswith("skipped"))
              for i in range(len(head))]
    lines = []
    for row in rows:
        if str(row[1]).startswith("skipped"):
            lines.append(f"{row[0]:<{widths[0]}}  {row[1]}")
        else:
            lines.append("  ".join(f"{str(c):>{w}}" if i else f"{str(c):<{w}}" for i, (c, w) in
                                   enumerate(zip(row, widths))))
    return "\n".join(lines)


def format_markdown(records: list[dict]) -> str:
    """A compact markdown table of `records` (for docs/benchmarks.md)."""
    lines = ["| config | step ms | fwd+bwd / optim ms | cpu ms | x plain | x DTensor | tokens/s | tp calls (theory) "
             "| tp MB sent/rank | tp meas/theory | dp MB sent/rank | dp meas/theory "
             "| weights / grads / masters / optim MB | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in records:
        if r.get("skipped"):
            lines.append(f"| {r['config']} | skipped: {r['skipped']} |" + " |" * 12)
            continue
        tp, dp, m = _group_total(r["comm_fwd_bwd"], "tp"), _group_total(r["comm"], "dp"), r["memory"]
        lines.append(
            f"| {r['config']}{'' if r['witness_agrees'] else ' (!)'} | {r['step_ms_median']:.0f} "
            f"| {r['fwd_bwd_ms_median']:.0f} / {r['optimizer_ms_median']:.0f} | {r['cpu_ms_median']:.0f} "
            f"| {_f(r['vs_plain'])} "
            f"| {_f(r['vs_dtensor'])} | {r['tokens_per_s']:.0f} | {tp['calls']} ({r['tp_theory']['calls']}) "
            f"| {tp['sent_bytes'] / MB:.2f} | {_f(r['tp_bytes_ratio'], '{:.4f}')} | {dp['sent_bytes'] / MB:.2f} "
            f"| {_f(r['dp_bytes_ratio'], '{:.4f}')} | {m['weights'] / MB:.2f} / {m['grads'] / MB:.2f} / "
            f"{m['masters'] / MB:.2f} / {m['optimizer_states'] / MB:.2f} | {r['peak_rss_mb']:.0f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2", help=f"comma list of {sorted(FAMILIES)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--intermediate", type=int, default=None, help="MLP width (default 4 * hidden)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10, help="timed steps per configuration")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--markdown", action="store_true", help="also print a markdown table per model")
    return p.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    all_records = []
    specs = [ModelSpec(family=family, layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq,
                       batch=args.batch, vocab=args.vocab, intermediate=args.intermediate)
             for family in args.model.split(",")]
    for spec, records in zip(specs, run_models(specs, args.configs.split(","), args.warmup, args.steps, args.threads)):
        print(f"\n== {spec.class_name}: layers={spec.layers} hidden={spec.hidden} heads={spec.heads} seq={spec.seq} "
              f"batch={spec.batch} vocab={spec.vocab} params={records[0].get('num_params', _num_params(spec)):,} "
              f"fp32, {args.steps} timed steps (median), {args.threads} thread(s)/process")
        print(format_table(records))
        print(LEGEND)
        print(format_summary(records))
        if args.markdown:
            print(format_markdown(records))
        for r in records:
            print("JSON " + json.dumps(r, default=str))
        all_records += records
    return all_records


if __name__ == "__main__":
    main()
