"""Time, bytes and peak extra memory per rank of `booster.export_weights` at three model sizes and several buckets.

    python benchmarks/export_weights.py                # Llama of 4, 16, 32 layers, tp=2 x pp=2 (4 ranks), fp32
    python benchmarks/export_weights.py --tp 2 --pp 1 --zero 1 --buckets 32 128

Each size is boosted once; for each bucket (MiB) every rank iterates the export `--repeat` times (rank 0's
consumer only counts what it receives, as an engine's `load_weights` that copies would see it), then once
more under torch's MemTracker, whose peak minus its start is the memory the export added on that rank (the
pairs the consumer receives included). A delta export with nothing changed is timed last. Rank 0 prints one
table row per (size, bucket): seconds and bytes per export, the GB/s, and the peak extra MiB on every rank
next to the bucket and the model's own size: the extra follows the bucket, not the model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# name -> (hidden, layers, intermediate, vocab): one width, so the largest tensor (the 32 MiB embedding) and
# the buckets stay while the model grows 4x
SIZES = {
    "4 layers": (512, 4, 1376, 16384),
    "16 layers": (512, 16, 1376, 16384),
    "32 layers": (512, 32, 1376, 16384),
}


def _peak_extra_mib(model, run) -> float:
    """The most memory `run()` holds at once beyond the model's own tensors (torch's MemTracker, every device;
    the model tracked first, so the views an export takes of its weights count as the weights, not as new)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        start = {d: v.get("Total", 0) for d, v in tracker.get_tracker_snapshot("current").items()}
        run()
        peak = tracker.get_tracker_snapshot("peak")
    return max(v.get("Total", 0) - start.get(d, 0) for d, v in peak.items()) / 2**20


def _body(rank: int, world: int, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import transformers as tfm

    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin

    rows = []
    for size in args.sizes:
        hidden, layers, inter, vocab = SIZES[size]
        config = tfm.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                                 vocab_size=vocab, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64)
        torch.manual_seed(0)
        model = tfm.LlamaForCausalLM(config)
        model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
        booster = Booster(plugin=HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, zero_stage=args.zero,
                                                      num_microbatches=1 if args.pp > 1 else None))
        model, *_ = booster.boost(model)
        for bucket_mib in args.buckets:
            bucket = max(int(bucket_mib * 2**20), largest)

            def export(**kw) -> int:
                received = 0
                for _, t in booster.export_weights(model, bucket_bytes=bucket, **kw):
                    received += t.numel() * t.element_size()
                return received

            dist.barrier()
            start = time.perf_counter()
            for _ in range(args.repeat):
                received = export()
            seconds = (time.perf_counter() - start) / args.repeat
            export(delta=True)                                   # fills the delta copies
            dist.barrier()
            start = time.perf_counter()
            delta_bytes = export(delta=True)
            delta_seconds = time.perf_counter() - start
            extra = [None] * world
            dist.all_gather_object(extra, round(_peak_extra_mib(model, export), 2))
            rows.append(dict(size=size, model_mib=model_bytes / 2**20, largest_mib=largest / 2**20,
                             bucket_mib=bucket / 2**20, seconds=seconds, bytes=received, delta_seconds=delta_seconds,
                             delta_bytes=delta_bytes, peak_extra_mib=extra))
        del model, booster
    if rank == 0:
        print(f"Llama, tp={args.tp} x pp={args.pp} x dp={world // (args.tp * args.pp)}, ZeRO-{args.zero}, fp32, "
              f"world {world}; {args.repeat} exports per row")
        print("| model | model MiB | bucket MiB | s / export | MiB / export | GB/s | delta (unchanged) s, bytes | "
              "peak extra MiB per rank |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for r in rows:
            print(f"| {r['size']} | {r['model_mib']:.0f} | {r['bucket_mib']:.1f} | {r['seconds']:.3f} | "
                  f"{r['bytes'] / 2**20:.0f} | {r['bytes'] / r['seconds'] / 1e9:.2f} | {r['delta_seconds']:.3f}, "
                  f"{r['delta_bytes']} | {' / '.join(f'{x:.1f}' for x in r['peak_extra_mib'])} |")
        print("JSON " + json.dumps(dict(tp=args.tp, pp=args.pp, zero=args.zero, world=world, rows=rows)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--buckets", nargs="+", type=float, default=[32, 64], help="bucket sizes in MiB (raised to "
                        "the largest tensor where smaller)")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    from meshboost.testing.spawn import spawn
    spawn(_body, args.world, args)


if __name__ == "__main__":
    main()
