"""`python -m meshboost.plan`'s bad inputs (issue 37 point 7): each is one line on stderr,
`meshboost.plan: error: ...`, exit status 2, naming the value and the fix; a model that fits nowhere
names the smallest layout's need and the change that fits; a table row's layout is accepted back by
--layout; --help shows the defaults and an example. Config only (meta models): no processes."""

from __future__ import annotations

import json

import pytest

from meshboost.plan.__main__ import main

TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=2,"
        "vocab_size=1000,max_position_embeddings=256")


def _error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshboost.plan: error: "), err
    return lines[0]


@pytest.fixture()
def configs(tmp_path):
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"model_type": "llama", "hidden_size": 64')
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"model_type": "llama", "hidden_size": "big"}))
    return tmp_path, corrupt, wrong


def test_bad_inputs_are_one_line_naming_value_and_fix(capsys, configs):
    folder, corrupt, wrong = configs
    rows = [  # (argv, words the line must hold)
        (["--model", str(folder / "missing" / "config.json")], ["no such file", "missing/config.json", "model type"]),
        (["--model", str(folder)], ["holds no config.json"]),
        (["--model", "lama"], ["'lama'", "did you mean llama"]),
        (["--model", str(corrupt)], ["corrupt.json", "not valid JSON", "line 1"]),
        (["--model", str(wrong)], ["hidden_size", "'big'", "fix"]),
        (["--model", "llama", "--set", TINY + ",hidden_size=big"], ["hidden_size", "--set"]),
        (["--model", "llama", "--set", TINY, "--gpus", "6", "--nodes", "4"], ["--gpus 6", "--nodes 4", "[1, 2, 3, 6]"]),
        (["--model", "llama", "--set", TINY, "--seq", "0"], ["--seq 0", "at least 1"]),
        (["--model", "llama", "--set", TINY, "--seq", "1000000000000"], ["--seq 1000000000000", "shorter --seq"]),
        (["--model", "gpt2", "--set", "n_embd=64,n_layer=2,n_head=4,vocab_size=1000", "--seq", "4096"],
         ["wpe: 1024 rows", "--set n_positions=4096"]),
        (["--model", "llama", "--set", TINY, "--gpus", "0"], ["--gpus 0", "--gpus 1 or more"]),
        (["--model", "llama", "--set", TINY, "--memory-gb", "-5"], ["--memory-gb -5", "positive"]),
        (["--model", "llama", "--set", TINY, "--global-batch", "0"], ["--global-batch 0"]),
        (["--model", "llama", "--set", TINY, "--gpus", "2", "--layout", "tp=x"], ["'tp=x'", "whole number"]),
        (["--model", "llama", "--set", TINY, "--gpus", "2", "--layout", "tp=2,fp8"], ["'fp8'", "bf16"]),
        (["--model", "llama", "--set", TINY, "--constants", str(folder / "none.json")], ["--calibrate --calibration"]),
        (["--model", "llama", "--set", TINY, "--top", "0"], ["--top 0"]),
        (["--model", "llama", "--set", TINY, "--lora-rank", "0"], ["--lora-rank 0", "1 or more"]),
        (["--model", "llama", "--set", TINY, "--lora-rank", "8", "--lora-targets", "qproj"],
         ["'qproj'", "not found", "q_proj,v_proj"]),
        (["--model", "llama", "--set", TINY, "--lora-rank", "8", "--lora-dropout", "1.5"], ["dropout 1.5", "[0, 1)"]),
        (["--model", "llama", "--set", TINY, "--lora-targets", "q_proj"], ["without --lora-rank"]),
        (["--seq", "4"], ["--model is required"]),
        (["--model", "llama", "--seq", "abc"], ["--seq", "'abc'"]),
    ]
    for argv, words in rows:
        line = _error(capsys, *argv)
        for word in words:
            assert word in line, (argv, line)
        assert "Traceback" not in line and len(line) < 400, line


def test_nothing_fits_names_the_smallest_need_and_the_change(capsys):
    # 2 layers of hidden 64 with a 1000-word vocabulary: the smallest layout needs ~2 MiB; 1 MiB devices
    with pytest.raises(SystemExit) as exit_:
        main(["--model", "llama", "--set", TINY, "--gpus", "2", "--seq", "64", "--global-batch", "4",
              "--memory-gb", str(1 / 1024)])
    out = capsys.readouterr()
    assert exit_.value.code == 2
    # one error line (a slow machine's progress lines before it: "meshboost.plan: 4 of 64 fake runs (3 s)")
    (line,) = [row for row in out.err.strip().splitlines() if "fake runs" not in row and "layouts" not in row
               or "error" in row]
    assert "no layout fits --memory-gb" in line and "the smallest, tp=" in line and "GiB per device" in line
    assert "fix: " in line
    assert out.out.startswith("no layout fits 2 devices")
    # each single change the advice tried is an estimate of the changed layout, needing less or more
    assert any("->" in row and "needs" in row for row in out.out.splitlines()[1:])


def test_nothing_fits_names_a_change_that_fits():
    # from a layout without checkpointing, ZeRO-1 with micro-batches of 2: with the device between what it
    # needs and what its cheapest single change needs, that change is the fix, given as a --layout
    from meshboost.plan import Layout, Planner
    from meshboost.plan.advice import needed_bytes, nothing_fits
    from meshboost.plan.model import parse_overrides
    planner = Planner("llama", parse_overrides(TINY), gpus=2, seq=64, global_batch=4)
    start = planner.explain(Layout.of(dp=2, zero=1, microbatches=1, microbatch_size=2))
    advice = nothing_fits(planner, [start])
    assert advice.smallest is start
    tried = {what.split(" ")[0] for what, _ in advice.changes}
    assert {"activation", "micro-batches", "pp=2", "context", "zero=3", "cpu"} <= tried, tried
    best = min(needed_bytes(planner, e) for _, e in advice.changes)
    assert best < needed_bytes(planner, start)
    planner.memory_bytes = (best + needed_bytes(planner, start)) / 2
    advice = nothing_fits(planner, [planner.explain(start.layout)])
    assert advice.changes[0][1].fits
    for _, e in advice.changes:
        assert e.fits == (needed_bytes(planner, e) <= planner.memory_bytes)
    fitting = [(what, e) for what, e in advice.changes if e.fits]
    what, e = min(fitting, key=lambda c: c[1].step_seconds)
    assert advice.fix(planner).startswith(what) and f"--layout {e.layout.describe()}" in advice.fix(planner)


def test_table_layout_is_accepted_back(capsys):
    from meshboost.plan.layout import Layout, parse_layout
    for layout in (Layout.of(tp=2, pp=1, dp=4, zero=1, microbatches=1, microbatch_size=8, checkpointing=True),
                   Layout.of(pp=2, dp=2, cp=2, cp_mode="ring_attn", zero=2, precision="fp32", microbatches=4,
                          microbatch_size=2, num_model_chunks=2),
                   Layout.of(tp=2, dp=2, ep=2, sequence_parallel=True, zero=1, cpu_offload=True)):
        assert parse_layout(layout.describe()) == layout, layout.describe()
    # ColossalAI's words for cp (sp_size, sequence_parallelism_mode) read as cp's; its split_gather is no cp
    assert parse_layout("dp=2,sp=2,sp_mode=ring_attn") == parse_layout("dp=2,cp=2,cp_mode=ring_attn") == Layout.of(
        dp=2, cp=2, cp_mode="ring_attn")
    assert parse_layout("pp=2,sp=2(all_to_all)") == Layout.of(pp=2, cp=2) and Layout.of(cp=2).cp_mode == "all_to_all"
    assert parse_layout("tp=2,sp_mode=split_gather") == parse_layout("tp=2,sp=split_gather") == Layout.of(
        tp=2, sequence_parallel=True) == parse_layout("tp=2,split_gather")
    code = main(["--model", "llama", "--set", TINY, "--gpus", "2", "--seq", "64", "--global-batch", "4", "--layout",
                 "tp=1,pp=1,dp=2,zero=1,bf16,mb=1x2,ckpt", "--json"])
    (entry,) = json.loads(capsys.readouterr().out)
    assert code == 0
    assert entry["layout"] | {} == {**entry["layout"], "dp": 2, "zero": 1, "precision": "bf16", "microbatches": 1,
                                    "microbatch_size": 2, "checkpointing": "full"}


def test_help_shows_defaults_and_an_example(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "(default: 2048)" in out and "(default: 80.0)" in out and "(default: bf16)" in out
    assert "example" in out and "python -m meshboost.plan --model llama" in out
