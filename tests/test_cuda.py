"""CUDA checks (marker `cuda`, skipped on a machine without a GPU; `benchmarks/gpu_check.sh` runs them):
a world of one spawned over NCCL trains a tiny Llama in bf16 with flash attention and fused norms
through the hybrid plugin, its first loss within bf16 tolerance of the fp32 model's, and TorchDDPPlugin
accepts fp8_communication and trains (at a world of one the hook has nothing to reduce); with two or more
GPUs, tensor parallelism (plain and sequence-parallel) over NCCL matches the unsharded model in fp32."""

import copy

import pytest
import torch

from meshboost.testing import LOSS_ATOL, spawn

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _world_of_one(rank: int, world: int) -> None:
    import torch.distributed as dist

    from meshboost import Booster
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.testing.compare import booster_step
    from meshboost.testing.models import build_model, tiny_batch, tiny_config
    assert dist.get_backend() == "nccl", dist.get_backend()
    config = tiny_config("llama")
    device = torch.device("cuda", torch.cuda.current_device())
    batch = {k: v.to(device) for k, v in tiny_batch("LlamaForCausalLM", config).items()}
    ref = build_model("LlamaForCausalLM", copy.deepcopy(config)).to(device)
    want = ref(**batch).loss.item()
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, precision="bf16", enable_flash_attention=True,
                                                  enable_fused_normalization=True))
    model, opt, *_ = booster.boost(model, opt)
    losses = []
    for _ in range(3):
        losses.append(booster_step(booster, model, opt, batch).item())
        opt.zero_grad()
    assert abs(losses[0] - want) <= LOSS_ATOL[torch.bfloat16] * 4, (losses, want)
    assert losses[-1] < losses[0], losses

    # fp8_communication is accepted on CUDA and its hook is the one DDP runs
    from meshboost.plugins import TorchDDPPlugin
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    plugin = TorchDDPPlugin(fp8_communication=True)
    assert plugin.fp8_communication
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    first = booster_step(booster, model, opt, batch).item()
    assert abs(first - want) <= LOSS_ATOL[torch.float32], (first, want)


def _tp(rank: int, world: int) -> None:
    import torch.distributed as dist

    from meshboost.testing.compare import check_tp_equivalence
    for options in ({}, {"enable_sequence_parallelism": True}):
        for cls, family in (("LlamaForCausalLM", "llama"), ("GPT2LMHeadModel", "gpt2")):
            check_tp_equivalence(cls, family, dist.group.WORLD, shard_options=options,
                                 device=torch.device("cuda", torch.cuda.current_device()))


def test_world_of_one_over_nccl_trains_in_bf16():
    spawn(_world_of_one, 1)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensor_parallel_over_nccl_matches_unsharded():
    spawn(_tp, 2)
