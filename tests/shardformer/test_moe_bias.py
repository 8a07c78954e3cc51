"""DeepSeek-V3's auxiliary-loss-free bias update (`moe_router_bias_update_rate`) against one process: the
reference trains the unsharded model on the whole global batch, counts each router's top-k loads with its
own hook and applies bias += rate * sign(mean - load) after every step; the boosted run (ep=2, tp=2) must
give the same losses, weights and biases after 3 steps. A rate on a model without biases is refused."""

from __future__ import annotations

import pytest
import torch

from meshboost.pipeline import PipelineConfig
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, ZeroConfig
from meshboost.testing import spawn
from meshboost.testing.moe import build_causal_lm, causal_batches, moe_config, train_boosted, train_whole_with_bias

RATE = 1e-2


def _body(rank, world_size):
    from meshboost.booster import Booster
    plain = build_causal_lm(moe_config("qwen3_moe"))          # no correction bias: refused at boost, every rank
    with pytest.raises(ValueError, match="moe_router_bias_update_rate=0.01: Qwen3MoeForCausalLM has no router"):
        Booster(plugin=HybridParallelPlugin(ep_size=2, moe_router_bias_update_rate=RATE)).boost(
            plain, torch.optim.AdamW(plain.parameters()))
    for family in ("deepseek_v3", "glm4_moe"):
        config = moe_config(family)
        batches = causal_batches(config, steps=3)
        losses, params, biases = train_whole_with_bias(config, batches, RATE)
        assert any(b.abs().sum() > 0 for b in biases.values())      # the update happened
        for layout in (dict(ep_size=2), dict(tp_size=2), dict(pp_size=2, pipeline=PipelineConfig(num_microbatches=2)),
                       dict(ep_size=2, zero=ZeroConfig(stage=3))):      # FSDP2 over edp / dp: the bias is a buffer
            cfg = HybridParallelConfig(**layout, moe_router_bias_update_rate=RATE)
            booster, model, _ = train_boosted(config, batches, cfg, losses, params, f"{family} {layout}")
            got = {n: b for n, b in model.unwrap().named_buffers() if n.endswith("e_score_correction_bias")}
            assert got.keys() <= biases.keys()      # a pipeline stage holds its own layers' routers
            held = torch.tensor([len(got)])
            torch.distributed.all_reduce(held)
            assert held.item() >= len(biases), f"{family} {layout}: routers held {held.item()} of {len(biases)}"
            for n, b in got.items():
                torch.testing.assert_close(b, biases[n], rtol=0, atol=1e-7, msg=f"{family} {layout} {n}")
            if "ep_size" in layout:          # the updated biases travel in the HF folder save_model writes
                _check_saved(booster, model, biases, f"{family} {layout}")


def _check_saved(booster, model, biases, what):
    import tempfile

    import transformers
    folder = tempfile.mkdtemp() if torch.distributed.get_rank() == 0 else None
    box = [folder]
    torch.distributed.broadcast_object_list(box, src=0)
    booster.save_model(model, box[0], shard=True)
    torch.distributed.barrier()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(box[0])
    for n, b in biases.items():
        torch.testing.assert_close(loaded.get_buffer(n), b, rtol=0, atol=1e-7, msg=f"{what} saved {n}")


def test_router_bias_update():
    spawn(_body, 2)


def test_flat_keywords():
    from meshboost.booster.plugin.hybrid_parallel_plugin import colossalai_config
    from meshboost.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
    import inspect
    assert "moe_router_bias_update_rate" in inspect.signature(MoeHybridParallelPlugin.__init__).parameters
    assert "moe_router_bias_update_rate" in inspect.signature(HybridParallelPlugin.__init__).parameters
    assert HybridParallelConfig.of(moe_router_bias_update_rate=RATE).moe_router_bias_update_rate == RATE


def test_rate_without_correction_bias_refused():
    config = moe_config("qwen3_moe")
    from meshboost.plugins.router_bias import check_model
    with pytest.raises(ValueError, match="moe_router_bias_update_rate=0.01: Qwen3MoeForCausalLM has no router"):
        check_model(build_causal_lm(config), RATE)
    with pytest.raises(ValueError, match="moe_router_bias_update_rate=-1"):
        HybridParallelConfig(moe_router_bias_update_rate=-1)
