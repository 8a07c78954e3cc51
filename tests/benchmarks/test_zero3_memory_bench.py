"""benchmarks/zero3_memory.py at its tiny size, one spawn of 4, HSDP 2x2 and ZeRO-3 with pp=2 x dp=2 (1F1B,
2 micro-batches): every rank's weights, gradients and AdamW moments are within 3% of the parameters its
stage holds / (dp_shard x tp) (x4 bytes, x8 for the moments), and the bytes of one step's all-gathers and
reduce-scatters over the shard axis and the all-reduce over the replicas equal the formula exactly (the
benchmark's own checks; under pp each unit gathered and reduce-scattered once per step, not once per
micro-batch), and the planner's prediction of each of these figures (meshboost.plan from the config alone)
equals the measurement exactly, rank by rank. Without a spawn: the planner's HSDP x ep state and replica
traffic against parameters counted from the tiny Qwen3-MoE (every dp rank holds its experts)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository root: `benchmarks`

from benchmarks.zero3_memory import main, make_config  # noqa: E402


def test_zero3_memory_benchmark_matches_its_formulas():
    runs = main(["--tiny", "--layouts", "hsdp2x2", "pp2dp2", "--seq", "8"])   # the others: docs/benchmarks.md
    assert [r["layout"] for r in runs] == ["hsdp2x2", "pp2dp2"]
    for run in runs:
        assert run["memory_within_3pct"] and run["traffic_matches_formula"], run
        assert run["planner_equals_measured"], [(r["memory"], r["planner_memory"], r["fsdp_traffic"],
                                                 r["planner_traffic"]) for r in run["ranks"]]
    for r in runs[0]["ranks"]:
        assert r["fsdp_traffic"]["all_reduce_replicas"] > 0, r        # the replicas did all-reduce
    hsdp = runs[0]["ranks"][0]
    assert hsdp["fsdp_traffic"]["dense_reduce_scatter"] == hsdp["params"] * 4     # every gradient, once per step
    assert hsdp["memory"]["weights"] == hsdp["params"] * 4 // 2               # 1/dp_shard of the model here
    stages = {r["coords"]["pp"]: r["stage_params"] for r in runs[1]["ranks"]}
    assert sum(stages.values()) == hsdp["params"] and min(stages.values()) > 0, stages   # each stage its own share
    for r in runs[1]["ranks"]:      # the stage's units gathered once in the step of 2 micro-batches
        assert r["fsdp_traffic"]["dense_all_gather"] == r["fsdp_traffic"]["dense_reduce_scatter"], r


def test_planner_hsdp_with_experts_counts_every_rank_s_experts():
    """ep=2 x dp=4, dp_replicate=2 (edp_shard 1): every dp rank holds half the experts whole and a half of
    the dense weights; the replicas all-reduce both (the benchmark's ep2rep2 row measured it)."""
    import torch

    from meshboost.plan import Planner
    from meshboost.plan.layout import Layout

    config = make_config(tiny=True, moe=True)
    with torch.device("meta"):
        import transformers
        model = transformers.AutoModelForCausalLM.from_config(config)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    dense = sum(p.numel() for p in model.parameters()) - experts
    layout = Layout.of(dp=4, ep=2, dp_replicate=2, zero=3, precision="fp32", microbatch_size=1)
    planner = Planner(config, gpus=4, seq=8, global_batch=4, precision="fp32", device="cpu")
    planner.check(layout)
    for dp_rank in range(4):
        assert planner.rank_state(layout, 0, 0, dp_rank)["weights"] == 4 * (experts // 2 + dense // 2), dp_rank
    assert planner.rank_comm(layout)["dp_replicate"] == [("all_reduce", 4 * (experts // 2 + dense // 2))]
