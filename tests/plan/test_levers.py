"""The planner's rows for two memory levers (issue 60 point 4): the chunked loss (`Layout.loss_chunk`,
`ShardConfig(loss_chunk_tokens=N)`) and selective recomputation (`Layout.checkpointing="selective"`).

The layout knobs parse, print and reach the plugin's config (`plugin_config`); the fake runs install the
runtime's own chunked head (`install_chunked_loss`) and checkpointing mode (`enable_checkpointing`), so the
predicted peak is compared with torch's MemTracker over a real step of the plugin the planner builds for the
same layout (benchmarks/plan_peak.py, each layout in processes of its own, the planner's usual tolerance:
within 5%, never under by more than 2%): benchmarks/chunked_loss.py's shape (a one-layer Llama of hidden 64,
2048 tokens, 32,000 words) with and without chunks of 256, and benchmarks/selective_recompute.py's (Llama
hidden 256, 4 layers, seq 512; no dropout: the harness's model) under none, selective and full. The cost
model: full recomputation adds the forward's matmul flops, selective none of them. "Nothing fits" offers both
levers as single changes, and the command line's --checkpointing / --loss-chunk reach every layout ranked.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest

from meshboost.plan.__main__ import main
from meshboost.plan.layout import Layout, parse_layout, plugin_config

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,"
        "vocab_size=1000")
LOW, HIGH = -0.02, 0.05         # the planner's peak tolerance (tests/plan/test_peak.py, fp32)


def _run(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(["--model", "llama", "--set", TINY, "--gpus", "2", "--seq", "64", "--global-batch", "4",
                     "--device", "cpu", *argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().out


def test_layout_knobs_parse_print_and_reach_the_plugin():
    assert parse_layout("tp=1,dp=1,ckpt").checkpointing == "full"
    assert parse_layout("dp=1,ckpt=1").checkpointing == "full"
    assert parse_layout("dp=1,ckpt=full").checkpointing == "full"
    assert parse_layout("dp=1,ckpt=selective").checkpointing == "selective"
    assert parse_layout("dp=1,ckpt=0").checkpointing is None
    assert parse_layout("dp=1").checkpointing is None and parse_layout("dp=1").loss_chunk is None
    assert Layout.of(checkpointing=True).checkpointing == "full"         # the older bool switch
    assert Layout.of(checkpointing=False).checkpointing is None
    layout = parse_layout("tp=1,dp=2,ckpt=selective,loss_chunk=256")
    assert layout.loss_chunk == 256 and layout.checkpointing == "selective"
    assert parse_layout(layout.describe()) == layout                       # a table row is accepted back
    assert parse_layout(Layout.of(dp=2, checkpointing="full").describe()).checkpointing == "full"
    config = plugin_config(layout)
    assert config.checkpointing == "selective" and config.sharding.loss_chunk_tokens == 256
    assert plugin_config(Layout.of(dp=2)).checkpointing is None
    assert plugin_config(Layout.of(dp=2)).sharding.loss_chunk_tokens is None
    for bad in ("dp=1,ckpt=partial", "dp=1,loss_chunk=0", "dp=1,loss_chunk=x"):
        with pytest.raises(ValueError):
            parse_layout(bad)
    with pytest.raises(ValueError, match="checkpointing='partial'"):
        Layout.of(checkpointing="partial")
    with pytest.raises(ValueError, match="loss_chunk_tokens=0"):
        Layout.of(loss_chunk=0)


def _peaks(spec, cases: list[dict]) -> list[tuple[float, int, int]]:
    from benchmarks.plan_peak import compare_peaks, measure_peaks

    out = []
    for fields in cases:
        err, measured, predicted, _ = compare_peaks(spec, fields, measure_peaks(spec, fields))
        assert LOW <= err <= HIGH, (fields, measured, predicted)
        out.append((err, measured, predicted))
    return out


def test_chunked_loss_peak_against_memtracker():
    from benchmarks.models import ModelSpec

    spec = ModelSpec(family="llama", layers=1, hidden=64, heads=2, seq=2048, batch=1, vocab=32000, intermediate=128)
    (_, whole, whole_predicted), (_, chunked, chunked_predicted) = _peaks(
        spec, [dict(precision="fp32"), dict(precision="fp32", loss_chunk=256)])
    # without chunks about three fp32 copies of the [2048, 32000] logits (262 MB each); with them one chunk's
    assert chunked < whole / 5 and chunked_predicted < whole_predicted / 5, (whole, chunked)


def test_selective_recomputation_peak_against_memtracker():
    from benchmarks.models import ModelSpec

    spec = ModelSpec(family="llama", layers=4, hidden=256, heads=4, seq=512, batch=1, vocab=1024)
    none, selective, full = _peaks(spec, [dict(precision="fp32", checkpointing=mode)
                                          for mode in (None, "selective", "full")])
    assert none[1] > selective[1] > full[1], (none, selective, full)             # measured
    assert none[2] > selective[2] > full[2], (none, selective, full)             # predicted


def test_recompute_time_counts_the_forward_matmuls_of_full_only():
    from meshboost.plan.cost import step_seconds

    args = dict(stage_numel=10 ** 9, seq=4096, hidden=4096, layers_held=32, comm={}, gpus_per_node=8)
    from meshboost.plan.cost import CostConstants
    constants = CostConstants()
    flops_only = dataclasses.replace(constants, layer_overhead_s=0.0)
    seconds = {mode: step_seconds(Layout.of(checkpointing=mode), constants=flops_only, **args)
               for mode in (None, "selective", "full")}
    # the compute without per-layer overheads: full's 8 flops per parameter and token against 6 (attention
    # 4 x against 3 x), selective's the same as none (its recomputed ops are not matmuls)
    assert seconds["selective"] == pytest.approx(seconds[None], rel=1e-12)
    assert 1.25 < seconds["full"] / seconds[None] < 1.34
    with_overhead = {mode: step_seconds(Layout.of(checkpointing=mode), constants=constants, **args)
                     for mode in (None, "selective", "full")}
    assert with_overhead[None] < with_overhead["selective"] < with_overhead["full"]


def test_nothing_fits_offers_both_levers_and_flags_reach_the_ranking(capsys):
    from types import SimpleNamespace

    from meshboost.plan.advice import _changes

    # a layout without recomputation or chunks: both levers among its single changes (each estimated by
    # `Planner.explain` in nothing_fits, refused there as no advice where the model cannot run it)
    offered = dict(_changes(SimpleNamespace(seq=64, context_parallel_ok=False), Layout.of(dp=2, microbatch_size=2)))
    assert offered["selective recomputation (ckpt=selective)"].checkpointing == "selective"
    assert offered["chunked loss (loss_chunk=128)"].loss_chunk == 128
    assert "selective recomputation (ckpt=selective)" not in dict(_changes(
        SimpleNamespace(seq=64, context_parallel_ok=False), Layout.of(dp=2, checkpointing="full")))
    # a large vocabulary at 1024 tokens: the smallest layout (full checkpointing) fits only with the chunked loss
    big = TINY.replace("vocab_size=1000", "vocab_size=32000").replace("num_hidden_layers=4", "num_hidden_layers=2")
    try:
        main(["--model", "llama", "--set", big, "--gpus", "1", "--seq", "1024", "--global-batch", "1",
              "--device", "cpu", "--precision", "fp32", "--memory-gb", "0.25"])
    except SystemExit as exc:
        assert exc.code != 0
    out = capsys.readouterr()
    assert "chunked loss (loss_chunk=1024)" in out.out and "fits" in out.out, out.out
    assert "fix: chunked loss" in out.err, out.err
    code, out = _run(capsys, "--checkpointing", "selective", "--loss-chunk", "32", "--json", "--all")
    assert code == 0
    rows = json.loads(out)
    assert {r["layout"]["checkpointing"] for r in rows} == {None, "selective"}
    assert {r["layout"]["loss_chunk"] for r in rows} == {32}
    code, out = _run(capsys, "--layout", "dp=2,ckpt=selective,loss_chunk=16", "--json")
    assert code == 0
    (row,) = json.loads(out)
    assert row["layout"]["checkpointing"] == "selective" and row["layout"]["loss_chunk"] == 16


def test_levers_at_tp2_against_memtracker():
    """Under tp the chunked head is the rank's vocabulary shard (padded, the last rank's padding masked) and
    the selective policy recomputes the blocks' all-reduces: each predicted peak within the tolerance."""
    from benchmarks.plan_cases import spec_of

    _peaks(spec_of("llama"), [dict(tp=2, precision="fp32", loss_chunk=48),
                              dict(tp=2, precision="fp32", checkpointing="selective")])
