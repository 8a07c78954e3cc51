"""Model FLOPs utilisation of Llama training on one CUDA device, side by side (issue 41):

    python benchmarks/gpu_mfu.py                    # every row for both models, each row its own process
    python benchmarks/gpu_mfu.py --dry-run          # every row on CPU with a tiny model (one process), to check it
    python benchmarks/gpu_mfu.py --row compile --model 0.94b [--steps 10 --warmup 3]   # one row, this process

Rows: plain PyTorch (fp32 weights + autocast bf16; bf16 weights and states), meshboost eager (bf16 with fp32
masters, flash attention and fused norms), meshboost + regional compile (`compile=True`), meshboost +
compile + float8 (torchao, tensorwise). Models: a 0.94B Llama at batch 8 x 2048 and a 3.1B one at 4 x 2048.
Each row prints ms/step, tokens/s, MFU against the datasheet's dense bf16 peak (the table below, or
MESHBOOST_PEAK_TFLOPS) and against the bf16 matmul rate measured in the same process, peak memory and the
loss after the last step. FLOPs per token: 6 N (N parameters, embeddings included) + 12 L h s (attention
scores and values, no causal discount), as in PaLM's appendix B. The dry run uses fp32, the "aot_eager"
compile backend and torchao's float8 emulation, so every row's code runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch

PEAK_BF16_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "L4": 121.0, "A10": 125.0}
ROWS = ("plain_autocast", "plain_bf16", "meshboost", "compile", "compile_float8")
# name -> (LlamaConfig sizes, batch, sequence)
MODELS = {
    "0.94b": (dict(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=16), 8, 2048),
    "3b": (dict(vocab_size=32000, hidden_size=3072, intermediate_size=8192, num_hidden_layers=26,
                num_attention_heads=24, num_key_value_heads=24), 4, 2048),
    "tiny": (dict(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4), 2, 64),
}


def peak_flops(device: torch.device) -> float | None:
    if os.environ.get("MESHBOOST_PEAK_TFLOPS"):
        return float(os.environ["MESHBOOST_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v * 1e12 for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def matmul_rate(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large square matmul in `dtype` on `device`, measured now (the achievable peak)."""
    n = 8192 if device.type == "cuda" else 256
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    _sync(device)
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        a @ b
    _sync(device)
    return 2 * n**3 * reps / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(row: str, sizes: dict, seq: int, dry: bool, device: torch.device):
    """(model, optimizer, step function) for one row."""
    import transformers

    config = transformers.LlamaConfig(**sizes, max_position_embeddings=seq)
    fused = device.type == "cuda"
    if row.startswith("plain"):
        config._attn_implementation = "sdpa"
        dtype = torch.bfloat16 if row == "plain_bf16" and not dry else torch.float32
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
        autocast = row == "plain_autocast" and not dry

        def step(data):
            with torch.autocast(device.type, torch.bfloat16, enabled=autocast):
                loss = model(**data).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
        return model, step
    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.lazy import LazyInitContext
    from meshboost.shardformer.compile import CompileConfig

    with LazyInitContext():
        model = transformers.LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    compile_config = None if row == "meshboost" else CompileConfig(backend="aot_eager" if dry else "inductor")
    plugin = HybridParallelPlugin(tp_size=1, precision="fp32" if dry else "bf16", enable_flash_attention=True,
                                  enable_fused_normalization=True, compile=compile_config,
                                  use_fp8=row == "compile_float8")
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    model.train()

    def step(data):
        loss = model(**data).loss
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        return loss
    return model, step


def run_row(row: str, model_name: str, steps: int, warmup: int, dry: bool) -> None:
    """Train `steps` measured steps after `warmup` ones and print the row's figures (one line)."""
    import torch.distributed as dist

    import meshboost

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(29500 + os.getpid() % 1000)).items():
        os.environ.setdefault(key, value)
    if not dist.is_initialized():
        meshboost.launch_from_torch(seed=0)
    torch.manual_seed(0)
    device = meshboost.get_current_device()
    if device.type != "cuda" and not dry:
        raise SystemExit("gpu_mfu.py measures a CUDA device; none is visible (use --dry-run on CPU)")
    sizes, batch, seq = MODELS[model_name]
    rate = matmul_rate(device, torch.float32 if dry else torch.bfloat16)
    model, step = _model(row, sizes, seq, dry, device)
    n_params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, sizes["vocab_size"], (batch, seq), generator=g).to(device)
    data = {"input_ids": ids, "labels": ids}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        _sync(device)
        start = time.perf_counter()
        loss = step(data)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    ms = statistics.median(times) * 1e3
    tokens = batch * seq / (ms / 1e3)
    flops = tokens * (6 * n_params + 12 * sizes["num_hidden_layers"] * sizes["hidden_size"] * seq)
    peak = peak_flops(device)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    print(f"gpu_mfu row: {model_name} {row:15s} {n_params / 1e9:.3f}B batch {batch}x{seq} | {ms:8.1f} ms/step | "
          f"tokens/s {tokens:9.0f} | MFU {flops / peak if peak else float('nan'):.3f} (datasheet) "
          f"{flops / rate:.3f} (matmul {rate / 1e12:.1f} TF/s measured) | peak {memory:.2f} GiB | "
          f"loss {loss.item():.4f} after {warmup + steps} steps", flush=True)


def run_all(args) -> int:
    """Every row of every model, each in a process of its own; returns how many failed."""
    models = ["tiny"] if args.dry_run else ["0.94b", "3b"]
    failed = 0
    for model_name in models:
        for row in ROWS:
            command = [sys.executable, __file__, "--row", row, "--model", model_name, "--steps", str(args.steps),
                       "--warmup", str(args.warmup)] + (["--dry-run"] if args.dry_run else [])
            try:
                done = subprocess.run(command, timeout=args.row_timeout)
                failed += done.returncode != 0
            except subprocess.TimeoutExpired:
                print(f"gpu_mfu row: {model_name} {row} did not finish in {args.row_timeout} s", flush=True)
                failed += 1
    print(f"gpu_mfu: {failed} row(s) failed")
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--row", choices=ROWS, help="one row, in this process (default: every row, each its own)")
    parser.add_argument("--model", choices=sorted(MODELS), default="0.94b")
    parser.add_argument("--steps", type=int, default=None, help="measured steps (default 7; dry run 1)")
    parser.add_argument("--warmup", type=int, default=None, help="steps before measuring (default 3; dry run 1)")
    parser.add_argument("--row-timeout", type=int, default=150)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, fp32, CPU allowed")
    args = parser.parse_args()
    args.steps = args.steps if args.steps is not None else (1 if args.dry_run else 7)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.dry_run else 3)
    if args.row is None and args.dry_run:      # the code of every row, in one process (a start costs more than a row)
        for row in ROWS:
            run_row(row, "tiny", args.steps, args.warmup, dry=True)
        return
    if args.row is None:
        raise SystemExit(1 if run_all(args) else 0)
    run_row(args.row, "tiny" if args.dry_run else args.model, args.steps, args.warmup, args.dry_run)


if __name__ == "__main__":
    main()
