"""Extra host memory per rank while `booster.save_model` and `booster.save_optimizer` write a ZeRO
model with fp32 masters and its AdamW state.

    python benchmarks/save_memory.py                      # GPT-2 124M, dp=4, ZeRO-1, fp16, 100 MB shards
    python benchmarks/save_memory.py --dp 2 --layers 6 --size_per_shard 50

Each rank resets its peak-RSS mark (Linux /proc/self/clear_refs) right before a save and prints
how far above its resident size the save took it, next to the bytes of all fp32 masters (what a
save that gathers every master on every rank first would add) and of one shard file (what the
writer may hold). The model is saved before any step (the masters exist from `boost` on); one
step on 16 tokens then gives AdamW its moments for the optimizer save.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _body(rank: int, world: int, args: argparse.Namespace, root: str) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tfm

    from meshboost import Booster
    from meshboost.plugins import HybridParallelPlugin

    config = tfm.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64, vocab_size=50304)
    torch.manual_seed(0)
    model = tfm.GPT2LMHeadModel(config)
    psi = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plugin = HybridParallelPlugin(tp_size=1, zero_stage=args.zero, precision=args.precision)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    def measured(save) -> tuple[float, float]:
        """(RSS before, peak extra during `save()`) in MiB."""
        import gc
        gc.collect()
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:      # reset the peak-RSS mark (VmHWM)
            f.write("5")
        before = _rss_kib("VmRSS")
        save()
        return before / 1024, (_rss_kib("VmHWM") - before) / 1024

    rss, model_extra = measured(lambda: booster.save_model(
        model, os.path.join(root, "model"), shard=True, size_per_shard=args.size_per_shard, use_safetensors=True))
    ids = torch.randint(0, config.vocab_size, (1, 16))
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()
    rss_opt, optim_extra = measured(lambda: booster.save_optimizer(
        optimizer, os.path.join(root, "optimizer"), shard=True, size_per_shard=args.size_per_shard))
    rows = [None] * world
    dist.all_gather_object(rows, {"rank": rank, "rss_mib": rss, "save_model_extra_mib": model_extra,
                                  "rss_after_step_mib": rss_opt, "save_optimizer_extra_mib": optim_extra})
    if rank == 0:
        masters_mib = 4 * psi / 2**20
        print(f"GPT-2 {psi / 1e6:.1f}M params, dp={world}, ZeRO-{args.zero}, {args.precision}; all fp32 masters "
              f"{masters_mib:.0f} MiB (this rank's share {masters_mib / world:.0f} MiB), masters + AdamW moments "
              f"{3 * masters_mib:.0f} MiB; shard files <= {args.size_per_shard} MB")
        print("| rank | RSS before save_model MiB | peak extra during save_model MiB | RSS before save_optimizer MiB "
              "| peak extra during save_optimizer MiB |")
        print("|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['rank']} | {r['rss_mib']:.0f} | {r['save_model_extra_mib']:.0f} | "
                  f"{r['rss_after_step_mib']:.0f} | {r['save_optimizer_extra_mib']:.0f} |")
        print("JSON " + json.dumps({"params": psi, "dp": world, "zero": args.zero, "precision": args.precision,
                                    "size_per_shard_mb": args.size_per_shard, "masters_mib": masters_mib,
                                    "ranks": rows}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--size_per_shard", type=float, default=100)
    args = parser.parse_args()
    from meshboost.testing.spawn import spawn
    with tempfile.TemporaryDirectory() as root:
        spawn(_body, args.dp, args, root)


if __name__ == "__main__":
    main()
