"""Time of one training step (forward + backward) with and without `jit_fuse`, the engine of
`enable_jit_fused` (issue 13), one process, fp32, on whatever device this runs on (CPU here):

    python benchmarks/jit_fused.py [--steps 20] [--layers 4] [--seq 128] [--batch 8]

Each model is timed eager and after `jit_fuse` (its pointwise activation chains `torch.compile`d with
dynamic shapes; single-op activations stay). Rows alternate between the two variants to share the
machine's noise; the median step time of each is printed, with the ratio. A second table times the
activations alone (forward + backward on a batch x seq x 4 hidden tensor), eager and compiled, to show
why a single-op activation is left alone.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import alternate, step_time  # noqa: E402


def models(layers: int) -> dict:
    import transformers as tfm
    bert = dict(vocab_size=4096, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                num_hidden_layers=layers, max_position_embeddings=512)
    return {
        "gpt2 (gelu_new)": ("GPT2LMHeadModel", tfm.GPT2Config(vocab_size=4096, n_embd=256, n_head=4, n_layer=layers,
                                                              n_positions=512)),
        "bert (gelu)": ("BertForMaskedLM", tfm.BertConfig(**bert)),
        "bert (gelu_new)": ("BertForMaskedLM", tfm.BertConfig(**bert, hidden_act="gelu_new")),
    }


def activation_time(fn, x: torch.Tensor) -> float:
    leaf = x.detach().requires_grad_()
    start = time.perf_counter()
    out = fn(leaf)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    import transformers as tfm
    from transformers.activations import GELUActivation, NewGELUActivation

    from meshboost.shardformer.optimizations import jit_fuse
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device={device.type} threads={torch.get_num_threads()} layers={args.layers} seq={args.seq} "
          f"batch={args.batch} steps={args.steps} (median of steps after 3 warm-up)")
    print(f"{'model':16s} {'eager':>10s} {'jit_fused':>10s} {'ratio':>6s}  compiled")
    for name, (cls, config) in models(args.layers).items():
        torch.manual_seed(0)
        base = getattr(tfm, cls)(config).to(device)
        fused = copy.deepcopy(base)
        start = time.perf_counter()
        swapped = jit_fuse(fused, device.type)
        setup = time.perf_counter() - start
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
        batch = {"input_ids": ids, "labels": ids}
        ms = alternate({"eager": base, "jit_fused": fused}, lambda model: step_time(model, batch), args.steps)
        print(f"{name:16s} {ms['eager']:7.2f} ms {ms['jit_fused']:7.2f} ms {ms['jit_fused'] / ms['eager']:6.3f}  "
              f"{swapped} modules (jit_fuse took {setup:.1f} s)")
    x = torch.randn(args.batch, args.seq, 4 * 256, device=device)
    print(f"\nactivation alone, forward + backward on {tuple(x.shape)}:")
    for act in (NewGELUActivation(), GELUActivation()):
        compiled = torch.compile(lambda t, act=act: act(t), dynamic=True)     # as jit_fuse would, if it did
        ms = alternate({"eager": act, "compiled": compiled}, lambda fn: activation_time(fn, x), args.steps)
        print(f"{type(act).__name__:18s} eager {ms['eager']:6.3f} ms  compiled {ms['compiled']:6.3f} ms  "
              f"ratio {ms['compiled'] / ms['eager']:.3f}")


if __name__ == "__main__":
    main()
