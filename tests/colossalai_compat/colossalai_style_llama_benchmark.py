"""A ColossalAI-style pretraining benchmark (shaped like ColossalAI's examples/language/llama/benchmark.py:
the same imports in ColossalAI's paths, PipelineGraph included, a Llama built from a config under
LazyInitContext, HybridAdam, `execute_pipeline` when pp > 1, the plugin choices gemini / gemini_auto /
fsdp / 3d / 3d_cpu). Data is seeded random tokens; rank 0 prints one JSON line `RESULT {...}` with the
mean loss of every step over the data-parallel replicas, so a test can compare it with one process.

    torchrun --nproc_per_node 2 colossalai_style_llama_benchmark.py -p 3d --tp 2 --zero 1
"""

import argparse
import json

import torch
import torch.distributed as dist
from torch.distributed.fsdp.fully_sharded_data_parallel import MixedPrecision  # noqa: F401  (as the script)
from transformers import AutoModelForCausalLM, LlamaConfig

import meshboost
from meshboost.accelerator import get_accelerator
from meshboost.booster import Booster
from meshboost.booster.plugin import GeminiPlugin, HybridParallelPlugin, TorchFSDPPlugin
from meshboost.cluster import DistCoordinator
from meshboost.lazy import LazyInitContext
from meshboost.nn.optimizer import HybridAdam
from meshboost.pipeline.schedule.v_schedule import PipelineGraph  # noqa: F401  (imported at module level)
from meshboost.shardformer import PipelineGradientCheckpointConfig
from meshboost.utils import get_current_device

CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
SEED, LR = 42, 1e-3


def batches(steps: int, batch: int, seq: int) -> torch.Tensor:
    """[steps, batch, seq] token ids, the same on every rank and in the test's reference."""
    return torch.randint(1, CONFIG["vocab_size"], (steps, batch, seq), generator=torch.Generator().manual_seed(7))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("-p", "--plugin", choices=["gemini", "gemini_auto", "fsdp", "3d", "3d_cpu"], default="3d")
    parser.add_argument("-b", "--batch_size", type=int, default=4, help="global batch")
    parser.add_argument("-s", "--num_steps", type=int, default=3)
    parser.add_argument("-l", "--max_length", type=int, default=16)
    parser.add_argument("-g", "--grad_checkpoint", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--mbs", type=int, default=1)
    parser.add_argument("--zero", type=int, default=0)
    args = parser.parse_args()

    meshboost.launch_from_torch(seed=SEED)
    coordinator = DistCoordinator()
    if args.plugin.startswith("gemini"):
        plugin = GeminiPlugin(precision="fp32", placement_policy="auto" if args.plugin == "gemini_auto" else "static",
                              enable_fused_normalization=get_accelerator().is_available())
    elif args.plugin == "fsdp":
        plugin = TorchFSDPPlugin()
    else:
        ckpt = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5) if args.grad_checkpoint else None
        plugin = HybridParallelPlugin(tp_size=args.tp, pp_size=args.pp, zero_stage=args.zero, precision="fp32",
                                      microbatch_size=args.mbs, cpu_offload=args.plugin == "3d_cpu",
                                      enable_fused_normalization=get_accelerator().is_available(),
                                      gradient_checkpoint_config=ckpt)
    booster = Booster(plugin=plugin)
    dp_size = getattr(plugin, "dp_size", coordinator.world_size)
    dp_rank = dist.get_group_rank(plugin.dp_group, coordinator.rank) if hasattr(plugin, "dp_group") \
        else coordinator.rank
    init_ctx = LazyInitContext(default_device=get_current_device())
    with init_ctx:
        model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    if args.grad_checkpoint:
        model.gradient_checkpointing_enable()
    optimizer = HybridAdam(model.parameters(), lr=LR)
    model, optimizer, *_ = booster.boost(model, optimizer)

    losses = []
    for step, ids in enumerate(batches(args.num_steps, args.batch_size, args.max_length)):
        ids = ids.chunk(dp_size)[dp_rank].to(get_current_device())
        batch = {"input_ids": ids, "labels": ids}
        if isinstance(plugin, HybridParallelPlugin) and args.pp > 1:
            out = booster.execute_pipeline(iter([batch]), model, criterion=lambda outputs, inputs: outputs[0],
                                           optimizer=optimizer, return_loss=True)
            loss = out["loss"] if plugin.stage_manager.is_last_stage(ignore_chunk=True) else None
        else:
            loss = model(**batch)[0]
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        # mean over the replicas: every last-stage rank adds its loss (tp ranks hold the same one)
        t = torch.zeros(2, device=get_current_device())
        if loss is not None:
            t[0], t[1] = loss.detach().float(), 1.0
        dist.all_reduce(t)
        losses.append((t[0] / t[1]).item())
    if coordinator.is_master():
        print("RESULT " + json.dumps({"losses": losses, "dp_size": dp_size}), flush=True)


if __name__ == "__main__":
    main()
