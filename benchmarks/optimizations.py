"""Time of one training step (forward + backward) with and without the kernel switches of issue 13
(`enable_flash_attention`, `enable_fused_normalization`), one process, fp32, on whatever device
this runs on (CPU here):

    python benchmarks/optimizations.py [--steps 20] [--layers 4] [--seq 128] [--batch 8]

Each model starts from eager attention and transformers' Python RMS norm; the switched copy runs
SDPA (flash-attn 2 on CUDA when installed) and the fused rms_norm kernel. Rows alternate between the
two variants to share the machine's noise; the median step time of each is printed, with the ratio.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):                    # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import alternate, step_time  # noqa: E402


def models(layers: int) -> dict:
    import transformers as tfm
    return {
        "llama": ("LlamaForCausalLM", tfm.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                                                      num_attention_heads=4, num_key_value_heads=4,
                                                      num_hidden_layers=layers, max_position_embeddings=512)),
        "gpt2": ("GPT2LMHeadModel", tfm.GPT2Config(vocab_size=4096, n_embd=256, n_head=4, n_layer=layers,
                                                   n_positions=512)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    import transformers as tfm

    from meshboost.shardformer import ShardConfig, ShardFormer
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device={device.type} threads={torch.get_num_threads()} layers={args.layers} seq={args.seq} "
          f"batch={args.batch} steps={args.steps} (median of steps after 3 warm-up)")
    for name, (cls, config) in models(args.layers).items():
        torch.manual_seed(0)
        base = getattr(tfm, cls)(config).to(device)
        base.set_attn_implementation("eager")
        switched = copy.deepcopy(base)
        ShardFormer(ShardConfig(enable_tensor_parallelism=False, enable_flash_attention=True,
                                enable_fused_normalization=True)).optimize(switched)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
        batch = {"input_ids": ids, "labels": ids}
        medians = alternate({"eager + python norm": base, "switches on": switched},
                            lambda model: step_time(model, batch), args.steps)
        ratio = medians["switches on"] / medians["eager + python norm"]
        print(f"{name:6s} " + "  ".join(f"{k}: {v:8.2f} ms" for k, v in medians.items())
              + f"  ratio {ratio:.3f} (attention {switched.config._attn_implementation})")


if __name__ == "__main__":
    main()
