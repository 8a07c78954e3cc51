"""Golden losses: a few families x layouts train 10 fp32 steps from seeded weights and data, and the
per-step losses must equal the checked-in `losses.json` (to 1e-6 relative: bitwise on the machine
that wrote them; the slack only absorbs another CPU's summation order). A refactor that moves a
number is caught here even where no single-process reference runs (issue 24).

Regenerate after a change that is *meant* to move numbers (say why in the commit):
    MESHBOOST_WRITE_GOLDEN=1 python -m pytest tests/golden -q
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.plugins import (
    HybridParallelConfig,
    HybridParallelPlugin,
    PipelineConfig,
    PrecisionConfig,
    ZeroConfig,
)
from meshboost.testing import spawn
from meshboost.testing.compare import booster_step
from meshboost.testing.models import build_model, tiny_batch, tiny_config

GOLDEN = os.path.join(os.path.dirname(__file__), "losses.json")
STEPS, GLOBAL_BATCH, RTOL = 10, 8, 1e-6

# name -> (model class, family, config overrides, the plugin's HybridParallelConfig); 4 ranks each.
# Built with meshboost's typed configs (the core constructor), not ColossalAI's flat keywords.
LAYOUTS = {
    "gpt2 tp2 dp2 zero1": ("GPT2LMHeadModel", "gpt2", {}, lambda: HybridParallelConfig(tp_size=2, zero=ZeroConfig(1))),
    "gpt2 tp2 dp2 zero3": ("GPT2LMHeadModel", "gpt2", {}, lambda: HybridParallelConfig(tp_size=2, zero=ZeroConfig(3))),
    "llama tp4 sp": ("LlamaForCausalLM", "llama", {}, lambda: HybridParallelConfig(
        tp_size=4, sequence_parallel=True)),
    "llama tp2 pp2 1f1b": ("LlamaForCausalLM", "llama", {}, lambda: HybridParallelConfig(
        tp_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2))),
    "opt pp2 dp2 interleaved zero2": ("OPTForCausalLM", "opt", {"num_hidden_layers": 4}, lambda: HybridParallelConfig(
        pp_size=2, pipeline=PipelineConfig(pp_style="interleaved", num_model_chunks=2, num_microbatches=4),
        zero=ZeroConfig(2))),
    "bert-cls dp4 ddp clip": ("BertForSequenceClassification", "bert", {}, lambda: HybridParallelConfig(
        precision=PrecisionConfig(max_norm=1.0))),
}


def _losses(class_name, family, overrides, plugin_config) -> list[float]:
    plugin = HybridParallelPlugin(plugin_config())
    config = tiny_config(family, **overrides)
    model = build_model(class_name, config, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    dp, dp_rank = plugin.mesh.dp_size, plugin.mesh.dp_rank
    out = []
    for step in range(STEPS):
        batch = tiny_batch(class_name, config, batch=GLOBAL_BATCH, seed=100 + step)
        if class_name.endswith("CausalLM") or class_name.endswith("LMHeadModel"):
            batch["labels"] = batch["input_ids"].clone()
        mine = {k: v.chunk(dp)[dp_rank] for k, v in batch.items()}
        loss = booster_step(booster, model, opt, mine).detach().reshape(1).float()
        opt.zero_grad()
        dist.all_reduce(loss)                 # the mean over every rank's replica loss
        out.append(loss.item() / dist.get_world_size())
    return out


def _body(rank, world, result_path):
    got = {name: _losses(*spec) for name, spec in LAYOUTS.items()}
    if rank == 0:
        with open(result_path, "w") as fh:
            json.dump(got, fh, indent=1, sort_keys=True)


def test_golden_losses(tmp_path):
    result = str(tmp_path / "losses.json")
    spawn(_body, 4, result)
    got = json.load(open(result))
    if os.environ.get("MESHBOOST_WRITE_GOLDEN") == "1":
        with open(GOLDEN, "w") as fh:
            json.dump(got, fh, indent=1, sort_keys=True)
            fh.write("\n")
    golden = json.load(open(GOLDEN))
    assert sorted(golden) == sorted(LAYOUTS), f"losses.json has {sorted(golden)}; regenerate it (see the docstring)"
    for name, losses in got.items():
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), f"{name}: {losses}"
        assert losses[-1] < losses[0], f"{name}: 10 steps did not lower the loss ({losses})"
        for step, (a, b) in enumerate(zip(losses, golden[name])):
            assert abs(a - b) <= RTOL * abs(b), f"{name} step {step + 1}: loss {a!r}, golden {b!r}"
