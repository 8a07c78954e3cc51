"""What the planner's benchmarks share (plan_accuracy.py, plan_peak.py, plan_ranking.py): a case's model
and layout, the plugin the planner builds for it, one training step, the planner that predicts it, and
running a measurement in spawned processes that each write a JSON result.

Owns: `spec_of` (the small models of the cases), `lora_of` / `layout_of` (a case's fields as the planner's
`LoraOptions` and `Layout`), `planner_for`, `boost_layout`, `forward_backward`, `spawn_json` with `write_json`
(one JSON file per rank in a temporary folder, read back in rank order), `case_indices` (the `--cases`
flag) and `quiet` (the benchmarks' environment). Must not hold cases or print tables (each benchmark's).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spec_of(family: str, batch: int = 12):
    from benchmarks.models import ModelSpec
    # vocabulary 1000: not a multiple of 64 x tp, so the vocab-parallel padding is exercised
    return ModelSpec(family=family, layers=4, hidden=128, heads=4, seq=32, batch=batch, vocab=1000)


LORA_FIELDS = {"lora_rank": "rank", "lora_targets": "targets", "lora_dropout": "dropout"}


def lora_of(fields: dict):
    """The planner's `LoraOptions` a case's fields name (lora_rank, ...), or None."""
    from meshboost.plan.lora import LoraOptions
    named = {LORA_FIELDS[k]: v for k, v in fields.items() if k in LORA_FIELDS}
    return LoraOptions(**named) if named else None


def layout_of(fields: dict, spec):
    from meshboost.plan import Layout
    f = {k: v for k, v in fields.items() if k not in LORA_FIELDS}
    dp, m = f.get("dp", 1), f.get("microbatches", 1)
    f.setdefault("microbatch_size", spec.batch // (dp * m))
    return Layout.of(**f)


def planner_for(spec, layout, lora=None, device="cpu"):
    """The planner of `spec` for `layout`'s world, predicting `device` (the measured processes': this
    machine's CPUs unless told)."""
    from benchmarks.models import build_config
    from meshboost.plan import Planner
    return Planner(build_config(spec), architecture=spec.class_name, gpus=layout.world, seq=spec.seq,
                   global_batch=spec.batch, precision=layout.precision, lora=lora, device=device)


def _criterion(outputs, inputs):
    return outputs.loss


def forward_backward(booster, model, optimizer, batch, pp: int) -> None:
    """One forward and backward of `batch` (through the pipeline's schedule when pp > 1); no optimizer step."""
    if pp > 1:
        booster.execute_pipeline(iter([batch]), model, _criterion, optimizer)
    else:
        booster.backward(model(**batch).loss, optimizer)


def boost_layout(fields: dict, spec):
    """(layout, plugin, booster, model, optimizer): a fresh model of `spec` boosted with AdamW by the plugin
    the planner builds for the layout of `fields` (with LoRA adapters through `booster.enable_lora` when the
    fields name them; the plugin then turns checkpointing on at boost in the layout's mode: the planner's fake
    run's order)."""
    import torch

    from benchmarks.models import build_model
    from meshboost import Booster
    from meshboost.plan.layout import plugin_config
    from meshboost.plugins import HybridParallelPlugin

    layout = layout_of(fields, spec)
    plugin = HybridParallelPlugin(plugin_config(layout))
    model = build_model(spec)
    booster = Booster(plugin=plugin)
    lora = lora_of(fields)
    if lora is not None:
        model = booster.enable_lora(model, lora_config=lora.peft_config())
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return layout, plugin, booster, model, optimizer


def write_json(outdir: str, rank: int, value) -> None:
    """This rank's result for `spawn_json`."""
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(value, f)


def spawn_json(worker, world: int, *args) -> list:
    """[per rank: what it wrote with `write_json`] after `worker(rank, world, *args, outdir)` ran in `world`
    spawned processes sharing one process group (`meshboost.testing.spawn`)."""
    from meshboost.testing.spawn import spawn
    with tempfile.TemporaryDirectory() as outdir:
        spawn(worker, world, *args, outdir)
        out = []
        for rank in range(world):
            with open(os.path.join(outdir, f"rank{rank}.json")) as f:
                out.append(json.load(f))
        return out


def case_indices(text: str | None, default) -> list[int]:
    """The `--cases` flag ("22,23") as indices, else `default`."""
    return [int(i) for i in text.split(",")] if text else list(default)


def quiet() -> None:
    """The benchmarks' environment: offline (the models are built from configs), transformers' warnings off."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
