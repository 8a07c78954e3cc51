"""benchmarks/zero3_memory.py at its tiny size, one spawn of 4: under HSDP 2x2 every rank's weights,
gradients and AdamW moments are within 3% of parameters / (dp_shard x tp) (x4 bytes, x8 for the moments),
and the bytes of one step's all-gathers and reduce-scatters over the shard axis and the all-reduce over the
replicas equal the formula exactly (the benchmark's own checks), and the planner's prediction of each of
these figures (meshboost.plan from the config alone) equals the measurement exactly, rank by rank."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository root: `benchmarks`

from benchmarks.zero3_memory import main  # noqa: E402


def test_zero3_memory_benchmark_matches_its_formulas():
    runs = main(["--tiny", "--layouts", "hsdp2x2", "--seq", "8"])      # the other layouts: docs/benchmarks.md
    assert [r["layout"] for r in runs] == ["hsdp2x2"]
    for run in runs:
        assert run["memory_within_3pct"] and run["traffic_matches_formula"], run
        assert run["planner_equals_measured"], [(r["memory"], r["planner_memory"], r["fsdp_traffic"],
                                                 r["planner_traffic"]) for r in run["ranks"]]
        for r in run["ranks"]:
            assert r["fsdp_traffic"]["all_reduce_replicas"] > 0, r        # the replicas did all-reduce
    hsdp = runs[0]["ranks"][0]
    assert hsdp["fsdp_traffic"]["reduce_scatter"] == hsdp["params"] * 4       # every gradient, once per step
    assert hsdp["memory"]["weights"] == hsdp["params"] * 4 // 2               # 1/dp_shard of the model here
