"""Where the per-step time goes: cProfile over training steps of plain PyTorch and meshboost, and
with --ops the torch operators (torch.profiler, self CPU time per operator and input shape).

    python benchmarks/profile_step.py                          # GPT-2, tp=1 and plain (1 process), tp=2 (2)
    python benchmarks/profile_step.py --model llama --configs tp2,zero1 --steps 10
    python benchmarks/profile_step.py --configs tp2,dtensor --ops 15  # the heaviest ops, meshboost vs DTensor

For each configuration, rank 0 profiles `--steps` steps after warm-up (the same runners and model as
train_step.py). It prints, per step: the step time with and without the profiler, the self time
spent in meshboost's own Python (functions whose file is under meshboost/), and the meshboost
functions that take most of it (self ms per step, calls per step). cProfile inflates Python-heavy
code, so the meshboost share is an upper bound of its overhead; the unprofiled step times are the
real ones. --ops N adds, per configuration, the N operators with the most self CPU time per step
(grouped by input shapes: an [N, vocab] copy stands out from the [batch, seq, hidden] ones), from a
second run of the same steps under torch.profiler; the time of a blocking collective counts as the
self time of the op that waits.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.models import ModelSpec
from benchmarks.runners import CONFIGS, make_runner
from meshboost.testing.spawn import free_port

PACKAGE = str(Path(__file__).resolve().parents[1] / "meshboost")


def _step(run) -> None:
    run.forward_backward()
    run.optimizer_step()
    run.zero_grad()


def _timed(run, steps: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        _step(run)
    dist.barrier()
    return (time.perf_counter() - start) / steps


def _op_table(run, steps: int, top: int) -> list[dict]:
    """The `top` operators by self CPU time per step, grouped by input shapes, over `steps` steps."""
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            _step(run)
    rows = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)
    return [{"op": e.key, "self_ms": e.self_cpu_time_total / 1e3 / steps, "calls": e.count / steps,
             "shapes": str(e.input_shapes)} for e in rows[:top]]


def _profile(key: str, spec: ModelSpec, warmup: int, steps: int, top: int, ops: int = 0) -> dict:
    run = make_runner(CONFIGS[key], spec)
    for _ in range(warmup):
        _step(run)
    plain_s = _timed(run, steps)
    profiler = cProfile.Profile()
    dist.barrier()
    start = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        _step(run)
    profiler.disable()
    profiled_s = (time.perf_counter() - start) / steps
    stats = pstats.Stats(profiler).stats          # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    ours = [(f"{Path(f).relative_to(Path(PACKAGE).parent)}:{line} {name}", nc / steps, tt / steps)
            for (f, line, name), (cc, nc, tt, ct, callers) in stats.items() if f.startswith(PACKAGE)]
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items()) / steps
    ours.sort(key=lambda r: -r[2])
    op_rows = _op_table(run, steps, ops) if ops else []
    return {"ops": op_rows, "config": key, "step_ms": plain_s * 1e3, "profiled_step_ms": profiled_s * 1e3,
            "profiled_total_ms": total * 1e3, "meshboost_self_ms": sum(r[2] for r in ours) * 1e3,
            "top": [{"function": f, "calls": round(c, 1), "self_ms": t * 1e3} for f, c, t in ours[:top]]}


def worker(rank: int, world: int, port: int, keys: list[str], spec: dict, warmup: int, steps: int, top: int,
           outdir: str, ops: int = 0) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from meshboost.distributed.launch import launch
    launch(rank, world, "127.0.0.1", port, local_rank=rank, seed=1024)
    try:
        results = [_profile(k, ModelSpec(**spec), warmup, steps, top, ops) for k in keys]
        if rank == 0:
            with open(os.path.join(outdir, f"world{world}.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--configs", default="plain,tp1,tp2")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--ops", type=int, default=0, help="also list the N heaviest torch operators per step")
    args = parser.parse_args()
    spec = ModelSpec(family=args.model, layers=args.layers, hidden=args.hidden, seq=args.seq, batch=args.batch)
    keys = args.configs.split(",")
    unknown = [k for k in keys if k not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs {unknown}: expected some of {sorted(CONFIGS)}")
    by_world: dict[int, list[str]] = {}
    for k in keys:
        by_world.setdefault(CONFIGS[k].world, []).append(k)
    results = []
    with tempfile.TemporaryDirectory() as outdir:
        for world, group in sorted(by_world.items()):
            mp.start_processes(worker, args=(world, free_port(), group, spec.as_dict(), args.warmup, args.steps,
                                             args.top, outdir, args.ops), nprocs=world, join=True, start_method="spawn")
            with open(os.path.join(outdir, f"world{world}.json")) as f:
                results += json.load(f)
    print(f"{spec.class_name}: {args.layers} layers, hidden {args.hidden}, seq {args.seq}, batch {args.batch}, fp32; "
          f"{args.steps} steps after {args.warmup} warm-up, rank 0, per step")
    for r in results:
        print(f"\n{CONFIGS[r['config']].label}: step {r['step_ms']:.1f} ms (profiled {r['profiled_step_ms']:.1f} ms); "
              f"meshboost Python self time {r['meshboost_self_ms']:.2f} ms "
              f"({100 * r['meshboost_self_ms'] / r['profiled_total_ms']:.1f}% of profiled time)")
        for t in r["top"]:
            print(f"  {t['self_ms']:7.3f} ms  {t['calls']:7.1f} calls  {t['function']}")
        if r["ops"]:
            print("  torch operators, self CPU ms per step (torch.profiler):")
        for o in r["ops"]:
            print(f"  {o['self_ms']:7.2f} ms  {o['calls']:6.1f} calls  {o['op']:<34s} {o['shapes'][:90]}")
        print("JSON " + json.dumps(r))


if __name__ == "__main__":
    main()
