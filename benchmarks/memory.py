"""Per-rank memory of training state, measured against the ZeRO paper's theory, for a small GPT-2
and Llama under HybridParallelPlugin:

    torchrun --nproc_per_node 4 benchmarks/memory.py --tp 2 --zero 1 --precision fp16

The accounting itself is `meshboost.optim.memory` (memory_breakdown, memory_theory); this file only
builds the models, runs a step and prints. tests/plugins/test_hybrid_precision.py calls `measure`.
"""

from __future__ import annotations

import argparse

import torch

from meshboost.optim.memory import memory_breakdown, memory_theory


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
    theory = memory_theory(num_params, tp_size, plugin.dp_size, zero_stage, precision,
                           overlap_communication=plugin.config.zero.overlap_communication)
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
