"""Peak host memory per rank when loading an HF checkpoint into a tensor-parallel model, or when
boosting a model built from its config under `LazyInitContext` over a (tp, pp, dp) layout.

Load: the model is built on the meta device (no weight memory), sharded, then `load_model` reads
only this rank's slices. Boost (`--boost`): the model is built under LazyInitContext and
`booster.boost` (HybridParallelPlugin, no optimizer) materialises only this rank's shards of its
stages. Prints, per layout, the peak private-memory growth of each rank and the parameter bytes it
owns (full / (tp x pp) for a stage of layers; the first and last stages also hold the tied embedding),
and what the peak adds to them against the fixed cost: materialisation initialises one unit (a layer,
or the embedding) at full size at a time.

    python benchmarks/load_memory.py --layers 12 --hidden 768 --tp 1 2 4
    python benchmarks/load_memory.py --boost 1,1,1 2,1,1 4,1,1 1,2,1 1,4,1 2,2,1 1,1,2 1,1,4
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


def _boost_body(rank, world, args, layout, out_file):
    import transformers as tfm

    from meshboost import Booster
    from meshboost.lazy import LazyInitContext
    from meshboost.booster.plugin import HybridParallelPlugin

    tp, pp, dp = layout
    base_anon = _anon_mb()
    with _AnonPeak() as sampler:
        with LazyInitContext(seed=0):
            model = tfm.GPT2LMHeadModel(_config(args))
        settings = {"num_microbatches": pp} if pp > 1 else {}
        plugin = HybridParallelPlugin(tp_size=tp, pp_size=pp, zero_stage=1 if dp > 1 else 0, **settings)
        model, *_ = Booster(plugin=plugin).boost(model)
    owned = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    stats = {"layout": f"tp{tp} pp{pp} dp{dp}", "rank": rank, "owned_param_mb": round(owned, 1),
             "peak_growth_mb": round(sampler.peak - base_anon, 1)}
    gathered = [None] * world
    dist.all_gather_object(gathered, stats)
    if rank == 0:
        with open(out_file, "a") as f:
            for s in gathered:
                f.write(json.dumps(s) + "\n")


def _boost_main(args) -> None:
    import transformers as tfm
    with torch.device("meta"):
        model = tfm.GPT2LMHeadModel(_config(args))
    full_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    unit_mb = max(model.transformer.wte.weight.numel(), sum(p.numel() for p in model.transformer.h[0].parameters())) \
        * 4 / 2**20
    with tempfile.TemporaryDirectory() as root:
        out_file = os.path.join(root, "stats.jsonl")
        for spec in args.boost:
            layout = tuple(int(x) for x in spec.split(","))
            spawn(_boost_body, layout[0] * layout[1] * layout[2], args, layout, out_file)
        rows = [json.loads(line) for line in open(out_file)]
    print(f"GPT-2 {args.layers} layers, hidden {args.hidden}, built from its config under LazyInitContext and boosted: "
          f"full fp32 parameters {full_mb:.1f} MB, largest unit (the embedding) {unit_mb:.1f} MB")
    print("| layout | rank | owned MB | peak growth MB | peak - owned MB | (peak - owned) / unit |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        extra = r["peak_growth_mb"] - r["owned_param_mb"]
        print(f"| {r['layout']} | {r['rank']} | {r['owned_param_mb']} | {r['peak_growth_mb']} | {extra:.1f} | "
              f"{extra / unit_mb:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--boost", nargs="+", metavar="TP,PP,DP",
                        help="measure boosting a LazyInitContext model over these layouts instead of loading")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.boost:
        _boost_main(args)
        return
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
