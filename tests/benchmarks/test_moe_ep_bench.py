"""benchmarks/moe_ep.py at a tiny size: on every rank the expert parameters equal experts / (ep x tp)
and the all-to-all bytes of one step equal the dispatch formula exactly (the benchmark's own checks,
which docs/benchmarks.md quotes), and ep=2 trains the loss ep=1 does."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository root: `benchmarks`

from benchmarks.moe_ep import main  # noqa: E402


def test_moe_ep_benchmark_matches_its_formulas():
    records = main(["--ep", "1", "2", "--batch", "1", "--seq", "16", "--warmup", "0", "--steps", "1"])
    assert [r["ep"] for r in records] == [1, 2]
    for r in records:
        assert r["expert_params_match"] and r["a2a_matches_formula"], r
    assert records[1]["tokens_mean_matches_balanced"], records[1]
    assert abs(records[0]["loss_per_rank"][0] - records[1]["loss_per_rank"][0]) < 1e-5
