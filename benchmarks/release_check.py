"""Memory given back when a boosted model is dropped (issue 37): in one process, boost, train one step
and drop a model with each plugin in turn, printing torch.cuda.memory_allocated() before the first
boost, after each drop (by reference counting alone, then after gc.collect()) and after the last drop.

    torchrun --nproc_per_node 1 benchmarks/release_check.py
    python benchmarks/release_check.py --dry-run      # a tiny model on CPU: bytes of live tensors instead

Exits 1 when more than 1 MiB is still held after the last drop and gc.collect(). On 2026-12-06 one H100
held 902.1 MiB from the first case on: 838.1 MiB, to the byte one fp32 copy of the model's 219.7M
gradients, DDP's buckets (ProcessGroupNCCL keeps an async collective's tensors until its work is waited,
and torch's default DDP hook never waits the work: meshboost's hook now does, plugins/ddp_hooks.py), and
64.0 MiB, cuBLAS's workspaces (now dropped by `free_case`). Not re-run on a GPU since. FSDP2's model
(TorchFSDPPlugin, zero_stage=3) is only given back at gc.collect(): torch's fully_shard ties it into
cycles of its own hooks (tests/reliability/test_release.py states which objects go when).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import warnings

import torch

CASES = {                       # name -> plugin (built after launch)
    "TorchDDPPlugin fp32": lambda p: p.TorchDDPPlugin(),
    "LowLevelZeroPlugin stage 2 bf16": lambda p: p.LowLevelZeroPlugin(stage=2, precision="bf16"),
    "HybridParallelPlugin ZeRO-1 bf16": lambda p: p.HybridParallelPlugin(zero_stage=1, precision="bf16"),
    "FSDPPlugin (ZeRO-3) fp32": lambda p: p.FSDPPlugin(),
}


def held_bytes(device: torch.device) -> int:
    """Device memory held by tensors: the allocator's count on CUDA, the storages of every live tensor
    Python tracks on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    storages = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")              # isinstance on lazily imported modules' proxies
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for t in tensors:
        try:
            storage = t.untyped_storage()
            if t.device.type == device.type and not t.is_meta:
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # wrapper subclasses (DTensor) hold real tensors, counted
            continue
    return sum(storages.values())


def free_case() -> None:
    """Between two benchmark cases in one process: collect what only gc.collect() frees (FSDP2's
    models), drop cuBLAS's workspaces (torch keeps one per handle and stream in the allocator once a
    matmul ran, 64 MiB on an H100: torch's own leak check drops them the same way), give the
    allocator's cache back and reset its peak, so the next case measures itself only."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_case(name: str, config, device: torch.device) -> None:
    """Boost a fresh model with `name`'s plugin, train one step; every reference goes when this returns."""
    import transformers

    import meshboost.plugins
    from meshboost import Booster
    plugin = CASES[name](meshboost.plugins)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, optimizer)
    ids = torch.randint(0, config.vocab_size, (2, 128), device=device)
    booster.backward(model(input_ids=ids, labels=ids).loss, optimizer)
    optimizer.step()
    optimizer.zero_grad()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny model on CPU")
    args = parser.parse_args()
    import transformers

    import meshboost
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", "29534")):
        os.environ.setdefault(key, value)
    meshboost.launch_from_torch(seed=0)
    device = meshboost.get_current_device()
    if not args.dry_run and device.type != "cuda":
        raise SystemExit("release_check.py measures a CUDA device; none is visible (use --dry-run on CPU)")
    hidden, layers = (64, 2) if args.dry_run else (1024, 12)        # ~0.2B parameters on the GPU
    config = transformers.LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8)
    what = "memory_allocated" if device.type == "cuda" else "live tensor bytes"
    gc.collect()
    start = held_bytes(device)
    print(f"release_check: {what} before the first boost: {start / 2**20:.1f} MiB")
    for name in CASES:
        run_case(name, config, device)
        at_once = held_bytes(device)
        free_case()
        print(f"release_check: {name}: {what} after the drop {at_once / 2**20:.1f} MiB, "
              f"after gc.collect() {held_bytes(device) / 2**20:.1f} MiB")
    end = held_bytes(device)
    print(f"release_check: {what} after the last drop: {end / 2**20:.1f} MiB (start {start / 2**20:.1f} MiB)")
    if end - start > 2**20:
        print(f"release_check: FAIL: {(end - start) / 2**20:.1f} MiB still held after every model was dropped")
        sys.exit(1)


if __name__ == "__main__":
    main()
