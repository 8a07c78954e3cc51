"""Per-rank memory accounting of training state, measured and in theory.

Owns: `memory_breakdown` (bytes this rank holds now: working weights, working/reduced gradients,
fp32 master weights, optimizer states, counted once per storage), `memory_theory` (the ZeRO
paper's figures for K = 12 bytes of Adam state per parameter: weights w*Psi/tp, gradients
w*Psi/tp (ZeRO-2: /dp), masters + moments 12*Psi/(tp*dp)), and a torchrun entry point that
prints both for a small GPT-2 and Llama:

    torchrun --nproc_per_node 4 -m meshboost.optim.memory --tp 2 --zero 1 --precision fp16

Must not allocate or communicate beyond what that entry point needs.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _bytes(tensors, seen: set, skip_scalars: bool = False) -> int:
    total = 0
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        t = getattr(t, "_local_tensor", t)           # a DTensor counts this rank's shard
        if skip_scalars and t.dim() == 0:            # Adam's step counters
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def memory_breakdown(model: nn.Module, optimizer=None) -> dict[str, int]:
    """Bytes this rank holds now, by kind: working weights, gradients (ZeRO-2's reduced partitions
    included), fp32 masters (tensors the inner optimizer steps that are not the weights) and
    optimizer states. Call it after backward (before step) to see gradients."""
    seen: set = set()
    params = list(model.parameters())
    working = _bytes(params, seen)
    grads = _bytes([p.grad for p in params], seen)
    if hasattr(optimizer, "grad_bytes"):
        grads += optimizer.grad_bytes()
    inner = optimizer
    while inner is not None and not isinstance(inner, torch.optim.Optimizer):
        inner = inner.unwrap() if hasattr(inner, "unwrap") else getattr(inner, "optim", None)
    masters = _bytes([m for g in inner.param_groups for m in g["params"]], seen) if inner is not None else 0
    states = _bytes([v for s in inner.state.values() for v in s.values()], seen, skip_scalars=True) \
        if inner is not None else 0
    return {"working_weights": working, "gradients": grads, "fp32_masters": masters, "optimizer_states": states,
            "total": working + grads + masters + states}


def memory_theory(num_params: int, tp_size: int = 1, dp_size: int = 1, zero_stage: int = 0,
                  precision: str = "fp16", state_bytes_per_param: int = 8) -> dict[str, float]:
    """Bytes per rank in theory for `num_params` (Psi) parameters; Adam keeps two fp32 moments
    (8 bytes). fp32 training keeps no separate masters."""
    w = _BYTES[precision]
    shard = num_params / tp_size
    partition = dp_size if zero_stage > 0 else 1
    out = {"working_weights": w * shard,
           "gradients": w * shard / (dp_size if zero_stage >= 2 else 1),
           "fp32_masters": 0.0 if precision == "fp32" and zero_stage == 0 else 4 * shard / partition,
           "optimizer_states": state_bytes_per_param * shard / partition}
    out["total"] = sum(out.values())
    return out


def small_models() -> dict:
    """A small GPT-2 and Llama (vocab a multiple of 64 * tp, so no vocab padding skews the count)."""
    import transformers as tfm
    return {
        "gpt2": ("GPT2LMHeadModel", tfm.GPT2Config(vocab_size=4096, n_embd=256, n_head=4, n_layer=2,
                                                   n_positions=128)),
        "llama": ("LlamaForCausalLM", tfm.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                                                      num_attention_heads=4, num_key_value_heads=4,
                                                      num_hidden_layers=2, max_position_embeddings=128)),
    }


def measure(family: str, tp_size: int, zero_stage: int, precision: str) -> tuple[dict, dict, int]:
    """One training step of a small `family` model under HybridParallelPlugin; returns
    (measured after backward, theory, parameter count). Needs an initialised process group."""
    import transformers as tfm

    from meshboost.booster import Booster
    from meshboost.plugins import HybridParallelPlugin

    class_name, config = small_models()[family]
    torch.manual_seed(0)
    model = getattr(tfm, class_name)(config)
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    plugin = HybridParallelPlugin(tp_size=tp_size, zero_stage=zero_stage, precision=precision)
    model, optimizer, *_ = Booster(plugin=plugin).boost(model, optimizer)
    ids = torch.randint(0, config.vocab_size, (1, 8))
    for _ in range(10):         # step until Adam has state (fp16 may skip overflowing steps) ...
        optimizer.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        optimizer.zero_grad()
        if len(optimizer.unwrap().state):
            break
    optimizer.backward(model(input_ids=ids, labels=ids).loss)    # ... then measure after a backward
    measured = memory_breakdown(model.unwrap(), optimizer)
    theory = memory_theory(num_params, tp_size, plugin.dp_size, zero_stage, precision)
    return measured, theory, num_params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--precision", default="fp16")
    parser.add_argument("--models", default="gpt2,llama")
    args = parser.parse_args()
    import torch.distributed as dist

    import meshboost
    meshboost.launch_from_torch(seed=0)
    for family in args.models.split(","):
        measured, theory, psi = measure(family, args.tp, args.zero, args.precision)
        if dist.get_rank() == 0:
            print(f"{family}: Psi={psi} tp={args.tp} dp={dist.get_world_size() // args.tp} zero={args.zero} "
                  f"{args.precision} (rank 0, MiB)")
            for key in measured:
                m, t = measured[key] / 2**20, theory[key] / 2**20
                ratio = measured[key] / max(theory[key], 1)
                print(f"  {key:17s} measured {m:8.3f}  theory {t:8.3f}  ratio {ratio:.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
