"""Per-rank memory of a LoRA training step with the bases in fp32 and in NF4 (QLoRA, `enable_lora(quantize=...)`),
at tp=1 and tp=2, measured by torch's MemTracker (meshboost.plan.tracker's, without module hooks; live tensor bytes, temporaries included), fp32 adapters:

    python benchmarks/qlora_memory.py [--hidden 512] [--layers 4] [--seq 256]

Each layout runs in its own processes (MemTracker would count what an earlier one left alive). Per rank it prints
the bytes the adapted bases hold (NF4: 4-bit codes, int8 scales, fp32 group factors), the same bases in bf16 for
scale, and the step's peak; the peak with NF4 keeps one layer's dequantized weight at a time, so it falls with the
bases while the activations stay. One JSON line per case follows the table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base_bytes(model) -> tuple[int, int]:
    """(bytes the adapted bases hold on this rank, the same elements in bf16)."""
    from meshboost.distributed.quantized import is_nf4

    held = bf16 = 0
    for name, p in model.named_parameters():
        if not name.endswith("base_layer.weight"):
            continue
        local = p.to_local() if hasattr(p, "to_local") else p
        bf16 += local.numel() * 2
        if is_nf4(local):
            held += sum(t.numel() * t.element_size() for t in
                        (local.quantized_data, local.quantized_scalers, local.quantization_factor))
        else:
            held += local.numel() * local.element_size()
    return held, bf16


def _worker(rank: int, world: int, args, quantize: bool, out: str) -> None:
    import peft
    import torch
    import transformers as tfm

    from meshboost import Booster
    from meshboost.booster import QuantConfig
    from meshboost.plan.tracker import device_bytes, live_bytes_tracker
    from meshboost.plugins import HybridParallelPlugin

    config = tfm.LlamaConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                             max_position_embeddings=args.seq, use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = tfm.LlamaForCausalLM(config).float()
    booster = Booster(plugin=HybridParallelPlugin(tp_size=world))
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    model = booster.enable_lora(model, lora_config=lora, quantize=QuantConfig() if quantize else False)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    model, optimizer, *_ = booster.boost(model, optimizer)
    ids = torch.randint(0, 1024, (2, args.seq), generator=torch.Generator().manual_seed(1))
    tracker = live_bytes_tracker()()            # MemTracker without the module hooks frozen weights refuse
    inner = getattr(optimizer, "optim", optimizer)
    tracker.track_external(inner, *[p.to_local() if hasattr(p, "to_local") else p for p in model.unwrap().parameters()])
    with tracker:
        loss = model(input_ids=ids, labels=ids).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        peak = device_bytes(tracker.get_tracker_snapshot("peak"))
    held, bf16 = _base_bytes(model.unwrap())
    row = {"tp": world, "rank": rank, "quantize": quantize, "base_bytes": held, "base_bf16_bytes": bf16,
           "peak_bytes": int(peak), "loss": loss.item()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(row, f)


def _one(args) -> list[dict]:
    from meshboost.testing import spawn

    tp, quantize, out = int(args.one[0]), args.one[1] == "nf4", args.one[2]
    spawn(_worker, tp, args, quantize, out)
    return [json.load(open(f"{out}.{r}")) for r in range(tp)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)          # tp fp32|nf4 out: a child
    args = parser.parse_args()
    if args.one:
        print("JSON " + json.dumps(_one(args)))
        return
    import tempfile
    mib = 2 ** 20
    print(f"{'tp':>3} {'bases':>6} {'rank':>5} {'base MiB':>9} {'bf16 MiB':>9} {'ratio':>6} {'peak MiB':>9}  loss")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tp in (1, 2):
            for kind in ("fp32", "nf4"):
                cmd = [sys.executable, __file__, "--one", str(tp), kind, os.path.join(tmp, f"{tp}{kind}"),
                       "--hidden", str(args.hidden), "--layers", str(args.layers), "--seq", str(args.seq)]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
                for row in json.loads(next(l for l in out.stdout.splitlines() if l.startswith("JSON "))[5:]):
                    rows.append(row)
                    print(f"{tp:>3} {kind:>6} {row['rank']:>5} {row['base_bytes'] / mib:>9.2f} "
                          f"{row['base_bf16_bytes'] / mib:>9.2f} {row['base_bytes'] / row['base_bf16_bytes']:>6.3f} "
                          f"{row['peak_bytes'] / mib:>9.1f}  {row['loss']:.5f}")
    for row in rows:
        print("JSON " + json.dumps(row))


if __name__ == "__main__":
    main()
