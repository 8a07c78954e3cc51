"""Issue 13, item 6: HF activation checkpointing (`gradient_checkpointing_enable()`, before boost or on
`model.unwrap()` after it) under tensor, pipeline and data parallelism with ZeRO gives the weights of
the unsharded model without checkpointing after an AdamW step (fp32; dropout off, so recomputation
replays the same numbers), also with ColossalAI's per-stage knob `PipelineGradientCheckpointConfig` (a
ratio, or a count per virtual stage), which checkpoints each stage's first layers. The stage hooks of a
pipeline sit outside the recomputed region: transformers 5 checkpoints a layer's forward inside the
module call, after the pre-hook that swaps in the received hidden states."""

import copy

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.pipeline import split_microbatches
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.shardformer import PipelineGradientCheckpointConfig
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import booster_step, gathered
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS, LR = "LlamaForCausalLM", 1e-3
RATIO = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5)
COUNTS = PipelineGradientCheckpointConfig(num_ckpt_layers_per_stage=[1, 0, 1, 1])    # 4 virtual stages
CASES = (  # plugin settings, checkpointing turned on before or after boost, the layers expected checkpointed
    ({"tp_size": 2, "zero_stage": 1}, "before", None),                    # tp=2 x dp=2, ZeRO-1
    ({"tp_size": 2, "pp_size": 2, "num_microbatches": 4}, "after", None),  # tp=2 x pp=2
    ({"tp_size": 1, "pp_size": 2, "num_microbatches": 2, "zero_stage": 1}, "before", None),   # pp=2 x dp=2
    # ColossalAI's per-stage knob: half of each stage's layers (its first), or a count per virtual stage
    ({"tp_size": 2, "pp_size": 2, "num_microbatches": 2, "gradient_checkpoint_config": RATIO}, "before",
     {0: [True, False], 1: [True, False]}),
    ({"tp_size": 1, "pp_size": 2, "num_microbatches": 4, "pp_style": "interleaved", "num_model_chunks": 2,
      "zero_stage": 1, "gradient_checkpoint_config": COUNTS}, "after", {0: [True, True], 1: [False, True]}),
    ({"tp_size": 2, "zero_stage": 1, "gradient_checkpoint_config": RATIO}, "before",
     {0: [True, True, False, False], 1: [True, True, False, False]}),
)


def _body(rank: int, world: int) -> None:
    config = tiny_config("llama", num_hidden_layers=4)
    batch = tiny_batch(CLS, config, batch=8, seed=7)
    ref = build_model(CLS, copy.deepcopy(config))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=1e-4)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    ref_opt.step()
    want = dict(ref.named_parameters(remove_duplicate=False))
    for settings, when, flags in CASES:
        model = build_model(CLS, copy.deepcopy(config))
        if when == "before":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=1e-4)
        plugin = HybridParallelPlugin(**settings)
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(model, opt)
        if when == "after":
            model.unwrap().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.unwrap().modules()), settings
        mine = split_microbatches(batch, plugin.dp_size)[plugin.mesh.dp_rank] if plugin.dp_size > 1 else batch
        loss = booster_step(booster, model, opt, mine)
        if flags is not None:     # this rank's layers (kept ones, in order) after the step's forwards
            held = [layer for layer in model.unwrap().model.layers if hasattr(layer, "gradient_checkpointing")]
            assert [layer.gradient_checkpointing for layer in held] == flags[plugin.mesh.pp_rank], settings
        if plugin.dp_size == 1:
            assert abs(loss.item() - ref_loss.item()) <= LOSS_ATOL[torch.float32], f"{settings}: {loss} vs {ref_loss}"
        for name, p in model.unwrap().named_parameters():
            assert_close(gathered(p), want[name].detach(), msg=f"checkpointing {when} boost {settings}: {name}")
        dist.barrier()


def test_activation_checkpointing_under_tp_pp_zero():
    spawn(_body, 4)


def test_per_stage_checkpoint_config_is_checked():
    with pytest.raises(ValueError, match="gradient_checkpointing_ratio"):
        PipelineGradientCheckpointConfig()
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=1.5)
    with pytest.raises(ValueError, match="has 4 entries; the pipeline has 2 stages"):
        COUNTS.layers_to_checkpoint(0, 2, num_stages=2)
    assert RATIO.get_num_ckpt_layers(0, 5) == 2
