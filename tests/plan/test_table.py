"""The planner's table and its advice (issue 56 item 9): the rows show the peak and what the device
reserves (what `fits` compares with --memory-gb), not the kinds' sum, under whole column names; a plan
for `--gpus` predicts those GPUs' peak on a machine without one; when nothing fits, the advice lists
only the changes that lower what the smallest layout needs, cpu offload among them."""

from __future__ import annotations

import json
import re
from unittest import mock

from meshboost.plan.__main__ import main

TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,"
        "vocab_size=1000")
ARGS = ["--model", "llama", "--set", TINY, "--gpus", "2", "--seq", "32", "--global-batch", "4"]
GIB = 2 ** 30


def _cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main([*ARGS, *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_rows_show_peak_and_reserved_for_the_gpus_planned(capsys):
    with mock.patch("torch.cuda.is_available", return_value=False):        # a machine without a GPU
        code, out, _ = _cli(capsys, "--all", "--top", "1000")
        _, text, _ = _cli(capsys, "--all", "--json")
    assert code == 0
    lines = out.splitlines()
    head = lines[1].split()
    assert head[:9] == ["layout", "weights", "gradients", "optimizer", "masters", "activations", "buffers", "peak",
                        "reserved"], head
    assert "total" not in head
    # the default device is the one --gpus plans: CUDA's margin and what lies outside its allocator
    assert lines[-1].startswith("peak predicted for device: cuda")
    estimates = json.loads(text)
    assert len(estimates) == len(lines) - 4
    for row, estimate in zip(lines[3:-1], estimates):
        memory = estimate["memory_bytes_per_rank"]
        assert memory["device"] == "cuda" and memory["outside"] > 0
        cells = row.split()
        assert cells[0] == row[:56].strip()
        assert float(cells[7]) == round(memory["peak"] / GIB, 2)
        assert float(cells[8]) == round((memory["reserved"] + memory["outside"]) / GIB, 2)
        assert estimate["fits"] == (memory["reserved"] + memory["outside"] <= 80 * GIB)
        assert cells[-1] == ("yes" if estimate["fits"] else "no")


def test_device_cpu_when_asked(capsys):
    code, out, _ = _cli(capsys, "--device", "cpu", "--top", "1")
    assert code == 0 and out.splitlines()[-1].startswith("peak predicted for device: cpu")


def test_nothing_fits_lists_only_changes_that_save():
    from meshboost.plan.advice import _changes, needed_bytes, nothing_fits
    from meshboost.plan.model import parse_overrides
    from meshboost.plan.planner import Planner
    from meshboost.plan.ranking import smallest

    planner = Planner("llama", parse_overrides(TINY), gpus=2, seq=32, global_batch=4, memory_gb=1 / 1024)
    least = smallest(planner)
    advice = nothing_fits(planner, [least])
    need = needed_bytes(planner, least)
    tried = []
    for what, layout in _changes(planner, least.layout):
        try:
            tried.append((what, needed_bytes(planner, planner.explain(layout))))
        except (ValueError, NotImplementedError, TypeError):
            continue
    saving = {what for what, bytes_ in tried if bytes_ < need}
    assert saving != {what for what, _ in tried}, tried     # some single change saves nothing: it is no advice
    assert [what for what, _ in advice.changes] == [what for what, _ in sorted(
        ((w, b) for w, b in tried if w in saving), key=lambda c: c[1])]
    assert any(what.startswith("cpu offload") for what in saving), tried    # offered from a layout without ZeRO
    lines = advice.lines(planner)
    assert all(re.search(r"GiB \(-[\d.]+\)", line) for line in lines[1:]), lines
