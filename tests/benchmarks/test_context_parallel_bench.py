"""benchmarks/context_parallel.py at a tiny size, one spawn of 2 processes: the cp group's bytes of one
training step equal each mode's formula exactly on every rank (all_to_all with 1 kv head, fewer than
sp: repeated to the query heads before the exchange; ring_attn: keys and values gathered), both modes
train the same loss, and the saved-activation search runs."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository root: `benchmarks`

from benchmarks.context_parallel import main


def test_context_parallel_benchmark_matches_its_formulas():
    records = main(["--sp", "2", "--tp", "--kv-heads", "1", "--layers", "1", "--seq", "32", "--start-seq", "32",
                    "--max-seq", "64", "--budget", str(10**9)])
    assert [r["layout"] for r in records] == ["all_to_all sp=2", "ring_attn sp=2"]
    for r in records:
        assert r["comm_matches_formula"], r
        assert r["saved_bytes_per_rank"] > 0 and r["longest_seq_within_budget"] == 64 and r["stopped_by_cap"], r
    # 1 kv head % sp=2 != 0: the all_to_all formula sends k and v at the 8 query heads
    assert records[0]["comm_formula_per_layer"]["all_to_all_forward"] == 1 * 16 * 16 * (2 * 8 + 2 * 8) * 4
    assert abs(records[0]["loss_per_rank"][0] - records[1]["loss_per_rank"][0]) < 1e-5
