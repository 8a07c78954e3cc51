"""Peak memory of one causal-LM training step (forward and backward) with and without the chunked loss
(`ShardConfig(loss_chunk_tokens=N)`, meshboost/shardformer/layers/chunked_loss.py), at tp=1 on one process,
fp32, measured by torch's MemTracker (live tensor bytes, temporaries included, the model's weights and
gradients in the figure). A one-layer Llama of hidden 64 at a large vocabulary, so the logits are the peak:

    python benchmarks/chunked_loss.py [--vocabs 32000 128000] [--seq 2048] [--chunk 256]

Each case runs in its own process (MemTracker would otherwise count what an earlier case left alive). Without
chunking transformers' loss holds the fp32 logits [seq, vocab] and their log-softmax and gradient: the peak
grows with vocab x tokens. With chunking one chunk's [chunk, vocab] at a time: the peak grows with
vocab x chunk (plus the weights), not with the token count. Prints one line per case and one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def _case(vocab: int, seq: int, chunk: int | None) -> dict:
    import torch
    import transformers as tfm
    from torch.distributed._tools.mem_tracker import MemTracker

    from meshboost.shardformer import ShardConfig, ShardFormer

    torch.manual_seed(0)
    config = tfm.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                             num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=seq,
                             tie_word_embeddings=False, use_cache=False)
    model = tfm.LlamaForCausalLM(config).float().train()
    if chunk is not None:
        ShardFormer(ShardConfig(loss_chunk_tokens=chunk)).shard(model)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        peak = max(v.get("Total", 0) for v in tracker.get_tracker_snapshot("peak").values())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"vocab": vocab, "seq": seq, "chunk": chunk, "peak_bytes": int(peak), "weight_bytes": weights,
            "logits_fp32_bytes": seq * vocab * 4, "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocabs", type=int, nargs="+", default=[32000, 128000])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)          # vocab seq chunk|none: a child
    args = parser.parse_args()
    if args.one:
        vocab, seq, chunk = args.one
        print("JSON " + json.dumps(_case(int(vocab), int(seq), None if chunk == "none" else int(chunk))))
        return
    print(f"{'vocab':>7} {'tokens':>7} {'chunk':>6} {'peak MiB':>9} {'weights MiB':>12} {'logits MiB':>11}  loss")
    for vocab in args.vocabs:
        for chunk in (None, args.chunk):
            out = subprocess.run([sys.executable, __file__, "--one", str(vocab), str(args.seq), str(chunk).lower()],
                                 capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, check=True)
            row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("JSON "))[5:])
            mib = 2 ** 20
            print(f"{vocab:>7} {row['seq']:>7} {str(chunk or '-'):>6} {row['peak_bytes'] / mib:>9.1f} "
                  f"{row['weight_bytes'] / mib:>12.1f} {row['logits_fp32_bytes'] / mib:>11.1f}  {row['loss']:.6f}")
            print("JSON " + json.dumps(row))


if __name__ == "__main__":
    main()
