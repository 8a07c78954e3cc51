"""Sequence parallelism against plain tensor parallelism: bytes per step, activations held after the
forward, and step time, per tp rank (fp32, whatever device this runs on; CPU + gloo here):

    python benchmarks/sequence_parallel.py [--tp 2] [--steps 10] [--layers 4] [--seq 128] [--batch 8]

Bytes are meshboost's own count of the tp group's collectives (ring cost per rank, as in
docs/benchmarks.md); "formula" is plain TP's bytes plus the sequence-parallel extras of
docs/sequence_parallel.md (stack entry and exit: 2 (P-1)/P b s h; the replicated parameters that see
the split sequence: one all-reduce each). Activations are the bytes autograd holds after the forward
(each storage view once); "split" is what sits in [batch, seq/tp, ...] tensors under SP, and theory says
SP holds (tp - 1) x split bytes less than TP. Step time is the median of alternating TP / SP steps.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist


def models(layers: int) -> dict:
    import transformers as tfm
    return {
        "gpt2": ("GPT2LMHeadModel", tfm.GPT2Config(vocab_size=4096, n_embd=256, n_head=4, n_layer=layers,
                                                   n_positions=512, resid_pdrop=0.0, embd_pdrop=0.0,
                                                   attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)),
        "llama": ("LlamaForCausalLM", tfm.LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=688,
                                                      num_attention_heads=4, num_key_value_heads=4,
                                                      num_hidden_layers=layers, max_position_embeddings=512)),
    }


def _replicated_elements(model) -> int:
    """Elements of the layers' parameters that see the split sequence (norms, row-parallel biases)."""
    from meshboost.distributed.param_info import get_tp_info
    from meshboost.shardformer.layers import RowParallelLinear
    stack = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    total = 0
    for layer in stack:
        for module in layer.modules():
            if "Norm" in type(module).__name__ or isinstance(module, torch.nn.LayerNorm):
                total += sum(p.numel() for p in module.parameters(recurse=False))
            if isinstance(module, RowParallelLinear) and module.bias is not None:
                total += module.bias.numel()
                assert get_tp_info(module.bias) is None
    return total


def _worker(rank: int, world: int, args) -> None:
    from meshboost.distributed.profiling import comm_counter
    from meshboost.optim.memory import saved_activation_bytes
    from meshboost.shardformer import ShardConfig, ShardFormer
    group = dist.group.WORLD
    torch.manual_seed(0)
    rows = []
    for name, (cls, config) in models(args.layers).items():
        import transformers as tfm
        base = getattr(tfm, cls)(config)
        ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
        batch = {"input_ids": ids, "labels": ids}
        built = {}
        for sp in (False, True):
            model = copy.deepcopy(base).train()
            shard_config = ShardConfig(tensor_parallel_process_group=group, enable_sequence_parallelism=sp)
            ShardFormer(shard_config).optimize(model)
            with comm_counter(names={group: "tp"}) as counter:
                held, saved, out = saved_activation_bytes(lambda: model(**batch))
                loss = out.loss
                loss.backward()
            model.zero_grad(set_to_none=True)
            split = sum(v for k, v in saved.items() if len(k[2]) == 3 and k[2][:2] == (args.batch, args.seq // world))
            built[sp] = model, held, split, counter.summary()["tp"]["sent_bytes"]
        times = {False: [], True: []}
        for _ in range(args.steps):
            for sp in (False, True):
                model = built[sp][0]
                dist.barrier()
                start = time.perf_counter()
                model(**batch).loss.backward()
                model.zero_grad(set_to_none=True)
                times[sp].append(time.perf_counter() - start)
        (_, tp_held, _, tp_bytes), (sp_model, sp_held, split, sp_bytes) = built[False], built[True]
        h = config.hidden_size if hasattr(config, "hidden_size") else config.n_embd
        formula = tp_bytes + 2 * (world - 1) / world * args.batch * args.seq * h * 4 \
            + 2 * (world - 1) / world * _replicated_elements(sp_model) * 4
        rows.append((name, tp_bytes, sp_bytes, formula, tp_held, sp_held, tp_held - (world - 1) * split,
                     statistics.median(times[False]) * 1e3, statistics.median(times[True]) * 1e3))
    if rank == 0:
        print(f"tp={world}, {args.layers} layers, hidden 256, seq {args.seq}, batch {args.batch}, fp32, "
              f"{'cuda' if torch.cuda.is_available() else 'cpu'}; per rank, one step")
        print("| model | TP MB sent | SP MB sent | formula MB | TP activations MB | SP activations MB | "
              "theory SP MB | TP ms | SP ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, tb, sb, fb, th, sh, theory, tt, st in rows:
            print(f"| {name} | {tb / 2**20:.3f} | {sb / 2**20:.3f} | {fb / 2**20:.3f} | {th / 2**20:.2f} | "
                  f"{sh / 2**20:.2f} | {theory / 2**20:.2f} | {tt:.1f} | {st:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    from meshboost.testing import spawn
    spawn(_worker, args.tp, args)


if __name__ == "__main__":
    main()
