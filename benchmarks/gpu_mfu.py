"""Model FLOPs utilisation of a ~1B-parameter Llama trained through meshboost on one CUDA device:

    torchrun --nproc_per_node 1 benchmarks/gpu_mfu.py [--steps 5] [--batch 4] [--seq 2048]
    python benchmarks/gpu_mfu.py --dry-run          # a tiny model on CPU, to check the script itself

bf16 weights with fp32 masters (HybridParallelPlugin(tp_size=1, precision="bf16")), flash attention
(flash-attn 2 when installed, else torch SDPA) and fused norms, the model built under LazyInitContext
(materialised on the device at boost). Prints tokens/s, MFU and peak device memory. FLOPs per token:
6 N (N parameters, embeddings included) + 12 L h s (attention scores and values, no causal discount),
as in PaLM's appendix B; the peak is the device's dense bf16 figure from the table below or
MESHBOOST_PEAK_TFLOPS.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0, "A10": 125.0}


def peak_flops(device: torch.device) -> float | None:
    if os.environ.get("MESHBOOST_PEAK_TFLOPS"):
        return float(os.environ["MESHBOOST_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, fp32, CPU allowed")
    args = parser.parse_args()
    import transformers

    import meshboost
    from meshboost import Booster
    from meshboost.lazy import LazyInitContext
    from meshboost.booster.plugin import HybridParallelPlugin

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    meshboost.launch_from_torch(seed=0)
    device = meshboost.get_current_device()
    if args.dry_run:
        config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
        batch, seq, precision, steps, warmup = 2, 64, "fp32", 2, 1
    else:
        if device.type != "cuda":
            raise SystemExit("gpu_mfu.py measures a CUDA device; none is visible (use --dry-run on CPU)")
        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504,
                                          num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                                          max_position_embeddings=args.seq)
        batch, seq, precision, steps, warmup = args.batch, args.seq, "bf16", args.steps, args.warmup
    with LazyInitContext():
        model = transformers.LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    plugin = HybridParallelPlugin(tp_size=1, precision=precision, enable_flash_attention=True,
                                  enable_fused_normalization=True)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    model.train()
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    data = {"input_ids": ids, "labels": ids}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        loss = model(**data).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    tokens = batch * seq / step
    flops_per_token = 6 * n_params + 12 * config.num_hidden_layers * config.hidden_size * seq
    peak = peak_flops(device)
    mfu = tokens * flops_per_token / peak if peak else float("nan")
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"gpu_mfu: {name}, {n_params / 1e9:.3f}B params, {precision}, batch {batch} x seq {seq}, "
          f"attention {model.unwrap().config._attn_implementation}, median step {step * 1e3:.1f} ms, "
          f"loss {loss.item():.3f}")
    print(f"gpu_mfu: tokens/s {tokens:.0f}  MFU {mfu:.3f}  peak memory {memory:.2f} GiB")


if __name__ == "__main__":
    main()
