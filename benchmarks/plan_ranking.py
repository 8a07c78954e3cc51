"""The planner's step-time ranking against measured steps on this machine (issue 28, point 3): run by
`python benchmarks/plan_accuracy.py --ranking`, whose docstring says how. Owns the ranking's layouts
(RANKING_LAYOUTS: a small Llama on 2 processes, tp / pp and its micro-batches / dp / ZeRO /
checkpointing / split_gather / context parallelism's two modes), their interleaved timing, Spearman's rank
correlation and the printed table; the models, layouts, plugins and steps are plan_cases.py's.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.plan_cases import (boost_layout, forward_backward, layout_of, planner_for, spawn_json,  # noqa: E402
                                   write_json)

RANKING_LAYOUTS = [
    dict(tp=2, precision="fp32"),
    dict(tp=2, precision="fp32", checkpointing=True),
    dict(dp=2, zero=0, precision="fp32"),
    dict(dp=2, zero=1, precision="fp32"),
    dict(dp=2, zero=2, precision="fp32", checkpointing=True),
    dict(pp=2, microbatches=2, precision="fp32"),
    dict(pp=2, microbatches=4, precision="fp32"),
    dict(pp=2, microbatches=8, precision="fp32"),
    # the sequence splits: split_gather over tp, context parallelism's two modes over cp
    dict(tp=2, sequence_parallel=True, precision="fp32"),
    dict(cp=2, precision="fp32"),
    dict(cp=2, cp_mode="ring_attn", precision="fp32"),
]
RANKING_WARMUP, RANKING_STEPS = 3, 20


def ranking_spec():
    from benchmarks.models import ModelSpec
    return ModelSpec(family="llama", layers=4, hidden=256, heads=4, seq=64, batch=8, vocab=1000)


def _ranking_worker(rank: int, world: int, layouts: list, outdir: str) -> None:
    """Every layout boosted at once, then timed in rounds (one step of each layout per round), so that
    a change in the machine's background load during the run falls on every layout alike."""
    import time

    import torch
    import torch.distributed as dist

    from benchmarks.models import make_batch

    spec = ranking_spec()
    runs = []
    for fields in layouts:
        layout, plugin, booster, model, optimizer = boost_layout(fields, spec)
        runs.append((layout, booster, model, optimizer, make_batch(spec, plugin.mesh.dp_size, plugin.mesh.dp_rank)))
    seconds: list[list[float]] = [[] for _ in layouts]
    for i in range(RANKING_WARMUP + RANKING_STEPS):
        for j, (layout, booster, model, optimizer, batch) in enumerate(runs):
            dist.barrier()
            start = time.perf_counter()
            forward_backward(booster, model, optimizer, batch, layout.pp)
            optimizer.step()
            optimizer.zero_grad()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)      # the step ends when the slowest rank's does
            if i >= RANKING_WARMUP:
                seconds[j].append(float(elapsed))
    write_json(outdir, rank, [sorted(s)[len(s) // 2] for s in seconds])     # alike on every rank (the MAX)


def measure_step_times(layouts: list[dict], world: int = 2) -> list[float]:
    """Median measured seconds per step of each layout (world processes, spawned)."""
    return spawn_json(_ranking_worker, world, layouts)[0]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their average rank)."""
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        out = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def predict_runs(runs_json: str) -> list[float]:
    """Each saved run's Spearman, predicted again from its saved constants by today's cost model."""
    import json

    from meshboost.plan.cost import CostConstants
    spec = ranking_spec()
    out = []
    for run in json.load(open(runs_json)):
        constants = CostConstants(**run["constants"])
        predicted = []
        for fields in RANKING_LAYOUTS:
            planner = planner_for(spec, layout_of(fields, spec))
            planner.constants = constants
            predicted.append(planner.explain(layout_of(fields, spec)).step_seconds)
        out.append(spearman(run["measured"], predicted))
        print(" ".join(f"{m / p:.2f}" for m, p in zip(run["measured"], predicted)), f"Spearman {out[-1]:.3f}")
    return out


def ranking(constants_file: str | None = None, world: int = 2, repeat: int = 1, runs_json: str | None = None) -> float:
    """Calibrate (or read `constants_file`), measure and predict RANKING_LAYOUTS `repeat` times (each
    calibrating anew); print the per-layout medians over the repeats; their Spearman. `runs_json`: each
    run's constants and measured seconds are written there too (`predict_runs` predicts them again)."""
    import dataclasses
    import json
    import statistics

    from meshboost.plan import calibrate
    spec = ranking_spec()
    runs, raw = [], []
    for _ in range(repeat):
        if constants_file:
            constants = calibrate.load(constants_file)
        else:
            constants = calibrate.calibrate(world, RANKING_LAYOUTS[0]["precision"])
        print(f"cost constants: {constants.source}")
        measured = measure_step_times(RANKING_LAYOUTS, world)
        predicted, terms = [], []
        for fields in RANKING_LAYOUTS:
            layout = layout_of(fields, spec)
            planner = planner_for(spec, layout)
            planner.constants = constants
            estimate = planner.explain(layout)
            predicted.append(estimate.step_seconds)
            slowest = max(estimate.per_stage, key=lambda s: s["step_seconds"])
            terms.append(slowest["step_seconds_terms"])
        if repeat > 1:
            print(f"  run {len(runs) + 1}: Spearman {spearman(measured, predicted):.3f}")
        runs.append((measured, predicted, terms))
        raw.append({"constants": dataclasses.asdict(constants), "measured": measured})
        if runs_json:
            with open(runs_json, "w") as f:
                json.dump(raw, f, indent=1)
    measured = [statistics.median(r[0][i] for r in runs) for i in range(len(RANKING_LAYOUTS))]
    predicted = [statistics.median(r[1][i] for r in runs) for i in range(len(RANKING_LAYOUTS))]
    terms = [{k: statistics.median(r[2][i][k] for r in runs) for k in runs[0][2][i]}
             for i in range(len(RANKING_LAYOUTS))]
    print(f"{spec.family} layers={spec.layers} hidden={spec.hidden} seq={spec.seq} global batch={spec.batch}, "
          f"world {world}: median of {RANKING_STEPS} steps after {RANKING_WARMUP} warm-up, layouts interleaved"
          + (f"; per layout the median of {repeat} runs, each calibrated anew" if repeat > 1 else ""))
    print(f"{'layout':44s} {'measured s':>10s} {'predicted s':>11s} {'rank m/p':>8s}   predicted terms (s)")
    order_m = {i: r for r, i in enumerate(sorted(range(len(measured)), key=measured.__getitem__))}
    order_p = {i: r for r, i in enumerate(sorted(range(len(predicted)), key=predicted.__getitem__))}
    for i, fields in enumerate(RANKING_LAYOUTS):
        t = terms[i]
        detail = " ".join(f"{k} {t[k]:.4f}" for k in ("compute", "overhead", "tp", "cp", "pp", "dp", "optimizer",
                                                       "zero_buffers"))
        print(f"{layout_of(fields, spec).describe():44s} {measured[i]:10.4f} {predicted[i]:11.4f} "
              f"{order_m[i] + 1:>4d}/{order_p[i] + 1:<3d}   {detail}")
    rho = spearman(measured, predicted)
    print(f"Spearman rank correlation over {len(measured)} layouts: {rho:.3f}")
    return rho


