"""Peak memory of one training step (forward and backward) with no recomputation, full recomputation
(`checkpointing="full"`) and selective recomputation (`checkpointing="selective"`,
meshboost/shardformer/selective.py), on one process in fp32, measured by meshboost's live-bytes MemTracker
(meshboost.plan.tracker: live tensor bytes, temporaries included, weights and gradients in the figure):

    python benchmarks/selective_recompute.py [--hidden 256] [--layers 4] [--seq 512]

A small Llama with attention dropout on (so the recompute replays masks). Each mode runs in its own process
(MemTracker would otherwise count what an earlier one left alive). Expected: full < selective < none, the
three losses equal, and the backward's matmul count of selective equal to none's (nothing it kept is
recomputed) while full recomputes each block's. Prints one line per mode and one JSON line each.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time


def _case(mode: str | None, hidden: int, layers: int, seq: int) -> dict:
    import torch
    import transformers as tfm
    from torch.utils._python_dispatch import TorchDispatchMode

    from meshboost.plan.tracker import device_bytes, live_bytes_tracker
    from meshboost.shardformer import enable_checkpointing

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    config = tfm.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                             max_position_embeddings=seq, attention_dropout=0.1, use_cache=False)
    model = tfm.LlamaForCausalLM(config).float().train()
    enable_checkpointing(model, mode)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    tracker = live_bytes_tracker()()
    tracker.track_external(model, ids)
    torch.manual_seed(2)
    start = time.perf_counter()
    with tracker:
        loss = model(input_ids=ids, labels=ids).loss
        with Matmuls() as counted:
            loss.backward()
    seconds = time.perf_counter() - start
    peak = device_bytes(tracker.get_tracker_snapshot("peak"))
    return {"mode": mode or "none", "hidden": hidden, "layers": layers, "seq": seq, "peak_bytes": int(peak),
            "backward_matmuls": sum(counted.count[k] for k in ("mm", "addmm", "bmm")), "loss": loss.item(),
            "step_s": round(seconds, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--one", help=argparse.SUPPRESS)          # none|full|selective: a child
    args = parser.parse_args()
    if args.one:
        row = _case(None if args.one == "none" else args.one, args.hidden, args.layers, args.seq)
        print("JSON " + json.dumps(row))
        return
    print(f"{'mode':>10} {'peak MiB':>9} {'bw matmuls':>11} {'step s':>7}  loss")
    for mode in ("none", "full", "selective"):
        out = subprocess.run([sys.executable, __file__, "--one", mode, "--hidden", str(args.hidden), "--layers",
                              str(args.layers), "--seq", str(args.seq)], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
        row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("JSON "))[5:])
        print(f"{mode:>10} {row['peak_bytes'] / 2 ** 20:>9.2f} {row['backward_matmuls']:>11} {row['step_s']:>7}  "
              f"{row['loss']:.7f}")
        print("JSON " + json.dumps(row))


if __name__ == "__main__":
    main()
