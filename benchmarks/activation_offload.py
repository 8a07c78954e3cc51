"""Bytes moved to host and step time of one training step (forward and backward) with activation offload
off and on (meshboost/shardformer/offload.py), with and without full checkpointing, on one process in fp32:

    python benchmarks/activation_offload.py [--hidden 256] [--layers 4] [--seq 512]

On CPU host and device are one memory: the "offload" is a copy into a separate host tensor, so the peak cannot
drop and the time is the copies' cost on this machine, not PCIe's; the bytes are what a GPU would move (the
saving there is a GPU figure, `max_memory_allocated`, not measured here). Each case runs in its own process;
the losses of a pair (off, on) are equal bitwise. Prints a table and one JSON line per case.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _case(offload: bool, checkpointing: str | None, hidden: int, layers: int, seq: int) -> dict:
    import torch
    import transformers as tfm

    from meshboost.plugins.speed import transformer_blocks
    from meshboost.shardformer import enable_checkpointing
    from meshboost.shardformer.offload import OffloadConfig, OffloadStats, install_offload

    torch.manual_seed(0)
    config = tfm.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=4, vocab_size=1024,
                             max_position_embeddings=seq, use_cache=False)
    model = tfm.LlamaForCausalLM(config).float().train()
    enable_checkpointing(model, checkpointing)
    offloader = install_offload(transformer_blocks(model), OffloadConfig(), "cpu") if offload else None
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(3):      # the first warms the allocator; the best of the last two is reported
        model.zero_grad(set_to_none=True)
        if offloader is not None:
            offloader.stats.reset()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        times.append(time.perf_counter() - start)
    stats = offloader.stats if offloader is not None else OffloadStats()
    return {"offload": offload, "checkpointing": checkpointing or "none", "hidden": hidden, "layers": layers,
            "seq": seq, "offloaded_bytes": stats.packed_bytes, "offloaded_tensors": stats.packed,
            "prefetched": stats.prefetched, "loss": loss.item(), "step_s": round(min(times[1:]), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--one", help=argparse.SUPPRESS)          # "on|off,none|full": a child
    args = parser.parse_args()
    sizes = ["--hidden", str(args.hidden), "--layers", str(args.layers), "--seq", str(args.seq)]
    if args.one:
        offload, checkpointing = args.one.split(",")
        row = _case(offload == "on", None if checkpointing == "none" else checkpointing, args.hidden, args.layers,
                    args.seq)
        print("JSON " + json.dumps(row))
        return
    print(f"{'checkpointing':>13} {'offload':>7} {'host MiB':>9} {'tensors':>8} {'step s':>7}  loss")
    for checkpointing in ("none", "full"):
        for offload in ("off", "on"):
            out = subprocess.run([sys.executable, __file__, "--one", f"{offload},{checkpointing}", *sizes],
                                 capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
            row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("JSON "))[5:])
            print(f"{checkpointing:>13} {offload:>7} {row['offloaded_bytes'] / 2 ** 20:>9.2f} "
                  f"{row['offloaded_tensors']:>8} {row['step_s']:>7}  {row['loss']:.7f}")
            print("JSON " + json.dumps(row))


if __name__ == "__main__":
    main()
