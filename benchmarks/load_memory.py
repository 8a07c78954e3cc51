"""Peak host memory per rank when loading an HF checkpoint into a tensor-parallel model.

The model is built on the meta device (no weight memory), sharded, then `load_model` reads only
this rank's slices. Prints, per tp size, the peak RSS growth of each rank during build+load and
the bytes of parameters it owns, next to the full model size.

    python benchmarks/load_memory.py --layers 12 --hidden 768 --tp 1 2 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile

import torch
import torch.distributed as dist

from meshboost.testing.spawn import spawn


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _anon_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class _AnonPeak:
    """Samples RssAnon (process-private memory, excluding the page cache of memory-mapped
    checkpoint files, which the kernel can drop and ranks share) every few milliseconds."""

    def __init__(self):
        import threading
        self.peak, self._stop = _anon_mb(), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _anon_mb())

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _anon_mb())


def _config(args):
    import transformers as tfm
    return tfm.GPT2Config(n_embd=args.hidden, n_layer=args.layers, n_head=args.hidden // 64, vocab_size=50257,
                          n_positions=1024, tie_word_embeddings=True)


def _load_body(rank, world, args, folder, out_file):
    import transformers as tfm

    from meshboost.checkpoint.load import load_model
    from meshboost.shardformer import ShardConfig, ShardFormer

    config = _config(args)
    base_anon, base_peak = _anon_mb(), _peak_mb()
    with _AnonPeak() as sampler:
        with torch.device("meta"):
            model = tfm.GPT2LMHeadModel(config)
        ShardFormer(ShardConfig(tensor_parallel_process_group=dist.group.WORLD)).optimize(model)
        load_model(model, folder, device=torch.device("cpu"))
    owned = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    stats = {"tp": world, "rank": rank, "owned_param_mb": round(owned, 1),
             "peak_growth_mb": round(sampler.peak - base_anon, 1),
             "rss_hwm_growth_mb": round(_peak_mb() - base_peak, 1)}
    gathered = [None] * world
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        with open(out_file, "a") as f:
            for s in gathered:
                f.write(json.dumps(s) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers as tfm

    with tempfile.TemporaryDirectory() as root:
        folder = os.path.join(root, "ckpt")
        torch.manual_seed(0)
        model = tfm.GPT2LMHeadModel(_config(args))
        full_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        model.save_pretrained(folder, safe_serialization=True, max_shard_size="200MB")
        del model
        out_file = os.path.join(root, "stats.jsonl")
        for tp in args.tp:
            spawn(_load_body, tp, args, folder, out_file)
        rows = [json.loads(line) for line in open(out_file)]
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}: full fp32 parameters {full_mb:.1f} MB")
    print("peak growth = peak private (anonymous) memory during build+load minus before; the page cache of")
    print("the memory-mapped files is shared between ranks and reclaimable, and is not counted")
    print(f"{'tp':>3} {'rank':>4} {'owned MB':>9} {'peak growth MB':>15} {'peak/owned':>11} {'peak/full':>10}")
    for r in rows:
        print(f"{r['tp']:>3} {r['rank']:>4} {r['owned_param_mb']:>9} {r['peak_growth_mb']:>15} "
              f"{r['peak_growth_mb'] / r['owned_param_mb']:>11.2f} {r['peak_growth_mb'] / full_mb:>10.2f}")
        print(json.dumps({**r, "full_param_mb": round(full_mb, 1)}))


if __name__ == "__main__":
    main()
