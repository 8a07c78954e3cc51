"""A training script as users write it for torchrun restarts (`--max-restarts`) and multi-node
launches: it calls booster.load_checkpoint at start, saves every few steps, and records each step's
global-batch loss. Used by test_elastic_restart.py and test_multinode.py; not a test itself.

    torchrun --nproc_per_node 4 --max-restarts 1 elastic_train.py --ckpt DIR --out losses.json \
        [--kill-rank 3 --kill-at 5] [--family llama] [--precision fp16]

--kill-rank/--kill-at: on the first attempt only, that rank SIGKILLs itself at that step (a lost
node); torchrun restarts every worker and the run resumes from the last committed step.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

import meshboost
from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing.models import VOCAB, build_model, tiny_config

CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}   # tied and untied LM heads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--save_every", type=int, default=2)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--family", default="gpt2", choices=sorted(CLASSES))
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=None)
    args = parser.parse_args()

    meshboost.launch_from_torch(seed=0)
    torch.set_num_threads(1)
    plugin = HybridParallelPlugin(tp_size=args.tp, zero_stage=1, precision=args.precision)
    booster = Booster(plugin=plugin)
    model = build_model(CLASSES[args.family], tiny_config(args.family), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(1, VOCAB, (48, 8), generator=torch.Generator().manual_seed(11))
    loader = plugin.prepare_dataloader(TensorDataset(ids), batch_size=2, shuffle=True, seed=5)
    model, optimizer, *_ = booster.boost(model, optimizer)

    meta = booster.load_checkpoint(args.ckpt, model, optimizer, dataloader=loader)
    step = meta["step"] if meta else 0
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    losses = {}
    epoch = loader.sampler.epoch
    while step < args.steps:
        loader.sampler.set_epoch(epoch)
        for (batch,) in loader:
            if attempt == 0 and step == args.kill_at and dist.get_rank() == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)          # a lost rank: no cleanup, no goodbye
            loss = model(input_ids=batch, labels=batch).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses[step] = mean.item() / dist.get_world_size()
            if step % args.save_every == 0:
                booster.save_checkpoint(args.ckpt, model, optimizer, dataloader=loader, step=step)
            if step == args.steps:
                break
        else:
            epoch += 1
    nodes = [None] * dist.get_world_size()              # which torchrun node (GROUP_RANK) holds each rank
    dist.all_gather_object(nodes, os.environ.get("GROUP_RANK", "0"))
    tp_nodes = {nodes[r] for r in dist.get_process_group_ranks(plugin.mesh.tp_group)}
    everywhere = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, len(tp_nodes) == 1)
    if dist.get_rank() == 0:
        path = f"{args.out}.attempt{attempt}"
        with open(path, "w") as fh:
            json.dump({"first_step": (meta["step"] if meta else 0) + 1, "losses": losses,
                       "nodes": sorted(set(nodes)), "tp_within_node": all(everywhere)}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
