"""The planner's reference-model row (`Planner(..., reference=True)`, meshboost/plan/reference.py) against a
real DPO step on this machine's CPUs:

    python benchmarks/plan_reference.py                     # the default layouts
    python benchmarks/plan_reference.py '{"tp": 2}' '{"dp": 2, "zero": 3, "precision": "bf16"}'

Each layout runs in processes of its own (`spawn_json`, as benchmarks/plan_peak.py). Every rank boosts a
frozen reference with `boost_reference` and the policy with AdamW by the plugin the planner builds for the
layout, runs two DPO steps (`preference_step`, then the optimizer's step), then a third under torch's
MemTracker (the policy, the reference, the inner optimizer, its masters and the pairs tracked; garbage
collection off over it; both models through `unwrap()`, which reshards FSDP2's units at zero 3, so what the
reference's forward gathers is made, and seen, under the tracker: a root gathered before it is reachable
from no tracked tensor and was missed), and reports: the reference's bytes (`memory_breakdown`'s working weights), the
bytes alive before and after its no-grad forward and their peak (the instant `reference`: the policy's state
kept between steps beside it), and the whole step's peak. The planner predicts the same rank from the config
alone on the CPU device model. Prints one line per rank. `measure` and `predict` are what
tests/plan/test_reference.py calls.
"""

from __future__ import annotations

import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.plan_cases import layout_of, planner_for, quiet, spawn_json, spec_of, write_json  # noqa: E402

DEFAULT = [dict(tp=2, precision="fp32"), dict(dp=2, zero=3, precision="bf16")]
BETA = 0.1


def pairs(spec, count: int, seed: int = 1) -> dict:
    """`count` pairs of `spec.seq` tokens (post_training's row fields): a 3-token prompt (-100), the response."""
    import torch

    out = {}
    for side, offset in (("chosen", 0), ("rejected", 100)):
        g = torch.Generator().manual_seed(seed + offset)
        ids = torch.randint(1, spec.vocab, (count, spec.seq), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100
        out |= {f"{side}_input_ids": ids, f"{side}_labels": labels, f"{side}_attention_mask": torch.ones_like(ids)}
    return out


def _worker(rank: int, world: int, spec_fields: dict, fields: dict, outdir: str) -> None:
    import torch

    from benchmarks.models import ModelSpec, build_model
    from meshboost import Booster
    from meshboost.optim.memory import memory_breakdown
    from meshboost.plan.layout import plugin_config
    from meshboost.plan.tracker import device_bytes, live_bytes_tracker
    from meshboost.plugins import HybridParallelPlugin
    from meshboost.post_training import (boost_reference, pair_batch, pipeline_sequence_logprobs, preference_step,
                                         sequence_logprobs)
    from meshboost.post_training.pipeline import pipeline_microbatches

    spec = ModelSpec(**spec_fields)
    layout = layout_of(fields, spec)
    plugin = HybridParallelPlugin(plugin_config(layout))
    booster = Booster(plugin=plugin)
    ref = boost_reference(booster, build_model(spec))
    weights = memory_breakdown(ref)["working_weights"]
    policy = build_model(spec)
    model, optimizer, *_ = booster.boost(policy, torch.optim.AdamW(policy.parameters(), lr=1e-4))
    mesh = plugin.mesh
    per_replica = spec.batch // 2 // mesh.dp_size
    rows = {k: v[mesh.dp_rank * per_replica:(mesh.dp_rank + 1) * per_replica].to(mesh.device)
            for k, v in pairs(spec, spec.batch // 2).items()}

    def step() -> None:
        preference_step(booster, model, optimizer, rows, "dpo", reference=ref, beta=BETA)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(2):                 # Adam's moments exist, the reference's root gathered (zero 3)
        step()
    gc.collect()
    out = {"ranks": (mesh.pp_rank, mesh.tp_rank, mesh.reduction_of([])[3]), "weights": weights}
    inner = optimizer.unwrap()
    masters = [p for group in inner.param_groups for p in group["params"]]
    collecting = gc.isenabled()
    gc.disable()
    try:
        # the reference's forward alone (a forward-only pipeline step under pp), the policy's state beside it
        microbatches = pipeline_microbatches(model, 2 * per_replica) if layout.pp > 1 else 1
        batch = pair_batch(rows, microbatches=microbatches)
        tracker = live_bytes_tracker()()
        tracker.track_external(model.unwrap(), inner, *masters, ref.unwrap(), *rows.values())
        with tracker:
            out["before"] = device_bytes(tracker.get_tracker_snapshot("current"))
            with torch.no_grad():
                scored = (pipeline_sequence_logprobs(booster, ref, batch, microbatches) if layout.pp > 1
                          else sequence_logprobs(ref, batch))
            out["after"] = device_bytes(tracker.get_tracker_snapshot("current"))
        out["reference_peak"] = device_bytes(tracker.get_tracker_snapshot("peak"))
        del scored, batch
        tracker = live_bytes_tracker()()
        tracker.track_external(model.unwrap(), inner, *masters, ref.unwrap(), *rows.values())
        with tracker:
            step()
        out["peak"] = device_bytes(tracker.get_tracker_snapshot("peak"))
    finally:
        if collecting:
            gc.enable()
    write_json(outdir, rank, out)


def measure(spec, fields: dict) -> list[dict]:
    """[per rank: {ranks, weights, before, after, reference_peak, peak}] of one layout, in processes of its
    own."""
    from dataclasses import asdict

    return spawn_json(_worker, layout_of(fields, spec).world, asdict(spec), fields)


def predict(spec, fields: dict, ranks, lora=None) -> dict:
    """The planner's figures for the rank at (pp, tp, dp) of `fields`' layout with a reference: its
    `reference_state`, the peak record with the reference (`with_reference`) and the one without."""
    from meshboost.plan import peak
    from meshboost.plan import reference as plan_reference

    layout = layout_of(fields, spec)
    planner = planner_for(spec, layout, lora)
    planner.reference = plan_reference.ON_DEVICE
    planner.check(layout)
    pp, tp, dp = ranks
    shards = planner.shards(layout, pp, tp)
    mem = planner.rank_memory(layout, pp, tp, dp, planner.stage_activations(layout, pp))
    without = peak.rank_peak(planner, layout, pp, shards, dp, mem)
    return {"state": plan_reference.reference_state(planner, layout, pp, tp, dp), "without": without,
            "with": plan_reference.with_reference(planner, layout, pp, tp, dp, mem, without), "memory": mem}


def main(argv: list[str]) -> None:
    quiet()
    spec = spec_of("llama")
    for fields in [json.loads(a) for a in argv] or DEFAULT:
        for m in measure(spec, fields):
            p = predict(spec, fields, tuple(m["ranks"]))
            line = (f"{json.dumps(fields):46s} rank {tuple(m['ranks'])}: weights {m['weights']} "
                    f"(planner {p['state']['weights']}), held {p['state']['held']}")
            pred, meas = p["with"]["instants"]["reference"], m["reference_peak"]
            line += (f"; reference forward: measured after-before {m['after'] - m['before']}, peak {meas}, "
                     f"planner {pred} ({(pred - meas) / meas:+.2%})")
            line += (f"; step peak measured {m['peak']}, planner {p['with']['peak']} "
                     f"({(p['with']['peak'] - m['peak']) / m['peak']:+.2%}, at {p['with']['instant']}; "
                     f"without the reference {p['without']['peak']})")
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
