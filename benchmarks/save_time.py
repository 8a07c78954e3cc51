"""How long `booster.save_checkpoint` blocks training, synchronous vs asynchronous, and what a save in
flight costs the training steps that run meanwhile (issue 63 point 1).

    python benchmarks/save_time.py                 # three GPT-2 sizes on the CPU, one process, < 1 min
    python benchmarks/save_time.py --sizes 2x256 --repeats 3

Per size (layers x width; vocab 8192; fp32 weights + AdamW moments, about 12 bytes per parameter on
disk): the median over `--repeats` of the time a synchronous save blocks (write, fsync, checksums,
commit), the time an asynchronous save blocks (staging into the reused host buffers; the first one,
which allocates them, apart) and the time until it is committed; then the median step time with no save and while an asynchronous save is
being written (the steps run until it commits). One process, no plugin: the figures are the writer's
own, not a layout's. The folder is a temporary one beside the repository (`--dir` to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _build(layers: int, width: int):
    import torch
    import transformers as tfm

    from meshboost import Booster

    torch.manual_seed(0)
    model = tfm.GPT2LMHeadModel(tfm.GPT2Config(n_layer=layers, n_embd=width, n_head=max(1, width // 64),
                                               vocab_size=8192, n_positions=128, bos_token_id=None,
                                               eos_token_id=None))
    booster = Booster()
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return booster, model, opt


def _step(booster, model, opt, ids) -> float:
    start = time.perf_counter()
    booster.backward(model(input_ids=ids, labels=ids).loss, opt)
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def _measure(layers: int, width: int, repeats: int, root: str) -> dict:
    import torch

    booster, model, opt = _build(layers, width)
    ids = torch.randint(0, 8192, (1, 32), generator=torch.Generator().manual_seed(0))
    _step(booster, model, opt, ids)                      # AdamW's moments exist from here on
    params = sum(p.numel() for p in model.parameters())
    sync, blocked, committed, step_in_flight = [], [], [], []
    plain = [_step(booster, model, opt, ids) for _ in range(2)]
    start = time.perf_counter()                          # the first asynchronous save allocates its buffers
    booster.save_checkpoint(os.path.join(root, "async"), model, opt, step=0, keep_last=1, asynchronous=True)
    first = time.perf_counter() - start
    booster.wait_for_checkpoint()
    for r in range(1, repeats + 1):
        start = time.perf_counter()
        booster.save_checkpoint(os.path.join(root, "sync"), model, opt, step=r, keep_last=1)
        sync.append(time.perf_counter() - start)
        start = time.perf_counter()
        booster.save_checkpoint(os.path.join(root, "async"), model, opt, step=r, keep_last=1, asynchronous=True)
        blocked.append(time.perf_counter() - start)
        while booster._saver.busy:                       # train on while the files are written
            step_in_flight.append(_step(booster, model, opt, ids))
        booster.wait_for_checkpoint()
        committed.append(time.perf_counter() - start)
    step_bytes = sum(f.stat().st_size for f in Path(root, "sync").rglob("*") if f.is_file())
    return {"layers": layers, "width": width, "params_m": params / 1e6, "step_mib": step_bytes / 2**20,
            "sync_s": statistics.median(sync), "first_async_blocks_s": first, "async_blocks_s": statistics.median(blocked),
            "async_committed_s": statistics.median(committed), "host_mib": booster._saver.buffers.nbytes / 2**20,
            "step_s": statistics.median(plain),
            "step_in_flight_s": statistics.median(step_in_flight) if step_in_flight else None,
            "steps_in_flight": len(step_in_flight)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1x128,2x256,3x384", help="layers x width, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary folder)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for size in args.sizes.split(","):
            layers, width = map(int, size.split("x"))
            rows.append(_measure(layers, width, args.repeats, os.path.join(root, size)))
    print("| model | params | step on disk MiB | sync save blocks s | async save blocks s (first: allocates) "
          "| async committed after s | host buffers MiB | train step s | train step with a save in flight s (n) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        flight = f"{r['step_in_flight_s']:.3f} ({r['steps_in_flight']})" if r["step_in_flight_s"] else "-"
        print(f"| GPT-2 {r['layers']}x{r['width']} | {r['params_m']:.1f}M | {r['step_mib']:.0f} | {r['sync_s']:.3f} | "
              f"{r['async_blocks_s']:.3f} ({r['first_async_blocks_s']:.3f}) | {r['async_committed_s']:.3f} | {r['host_mib']:.0f} | {r['step_s']:.3f} | "
              f"{flight} |")
    print("JSON " + json.dumps(rows))


if __name__ == "__main__":
    main()
