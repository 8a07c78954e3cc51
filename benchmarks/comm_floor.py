"""How far communication keeps meshboost tp=2 from its compute floor on this machine.

    python benchmarks/comm_floor.py --model llama,gpt2,bert --steps 12

One 2-process group per model; each round, step by step in the same processes: plain PyTorch (rank 0
computes, rank 1 waits at the barrier), meshboost tp=2 (its all-reduces on the backend: gloo's sockets
on CPU, NCCL on CUDA), and tp=2 with every all-reduce skipped: timing only, its numbers are wrong
(each rank keeps its partial sums) but it does every FLOP of the step, so its time is what tp=2 would
take with free, perfectly synchronised communication. Prints the median of per-round ratios to plain
(the paired ratio `train_step.py` prints) and how much of plain's step the communication costs. Same
models, sizes and data as train_step.py (benchmarks/models.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.models import FAMILIES, ModelSpec
from benchmarks.runners import CONFIGS, make_runner
from meshboost.testing.spawn import free_port

ROWS = ("plain", "tp=2", "tp=2, all-reduces skipped")


@contextlib.contextmanager
def _transport(row: str):
    from meshboost.distributed import comm

    real = comm._all_reduce
    if row == "tp=2, all-reduces skipped":
        comm._all_reduce = _skipped
    try:
        yield
    finally:
        comm._all_reduce = real


def _skipped(tensor, group, op, async_op=False):
    """No transport: the result keeps this rank's part."""


def _step(runner) -> float:
    start = time.perf_counter()
    runner.forward_backward()
    runner.optimizer_step()
    runner.zero_grad()
    return time.perf_counter() - start


def _worker(rank: int, port: int, spec_dicts: list[dict], warmup: int, steps: int, out: dict) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    from meshboost.distributed.launch import launch
    launch(rank, 2, "127.0.0.1", port, local_rank=rank, seed=1024)
    try:
        for spec_dict in spec_dicts:
            spec = ModelSpec(**spec_dict)
            tp2 = make_runner(CONFIGS["tp2"], spec)
            plain = make_runner(CONFIGS["plain2"], spec) if rank == 0 else None
            times = {row: [] for row in ROWS}
            for i in range(warmup + steps):
                order = ROWS if i % 2 == 0 else ROWS[::-1]        # A B C D, D C B A: drifts hit every row
                for row in order:
                    dist.barrier()
                    if row == "plain":
                        seconds = _step(plain) if rank == 0 else 0.0
                    else:
                        with _transport(row):
                            seconds = _step(tp2)
                    slowest = torch.tensor([seconds])
                    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                    if i >= warmup:
                        times[row].append(slowest.item())
            if rank == 0:
                out[spec.family] = times
            del tp2, plain
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama,gpt2,bert", help=f"comma list of {sorted(FAMILIES)}")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args(argv)
    specs = [ModelSpec(family=f.strip()) for f in args.model.split(",")]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(free_port(), [s.as_dict() for s in specs], args.warmup, args.steps, out),
                           nprocs=2, join=True, start_method="spawn")
        results = dict(out)
    print(f"{'model':<7} " + "  ".join(f"{row + ' ms':>27}" for row in ROWS) + "   tp=2 / plain  skipped / plain"
          "   communication, share of plain")
    for spec in specs:
        t = results[spec.family]
        ratio = {row: statistics.median(a / b for a, b in zip(t[row], t["plain"])) for row in ROWS}
        print(f"{spec.family:<7} " + "  ".join(f"{1e3 * statistics.median(t[row]):>27.1f}" for row in ROWS)
              + f"   {ratio['tp=2']:>12.3f} {ratio['tp=2, all-reduces skipped']:>16.3f}"
              + f"   {ratio['tp=2'] - ratio['tp=2, all-reduces skipped']:>30.3f}")


if __name__ == "__main__":
    main()
