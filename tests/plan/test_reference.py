"""The planner's row for a frozen reference model (`Planner(..., reference=True)`, `--reference`,
meshboost/plan/reference.py), against the runtime's `boost_reference` in a real DPO step on CPU
(benchmarks/plan_reference.py: MemTracker, each layout in processes of its own, as test_peak.py's):

- the reference's bytes per rank equal `memory_breakdown(reference)`'s working weights exactly (tp=2: its tp
  shard; pp=2: its stage; dp=2 zero=3: FSDP2's fp32 shards), and what its no-grad forward leaves alive is
  the planner's `gathered` (zero=3: the root unit, kept gathered; else nothing);
- the instant `reference` (the policy's state kept between steps, the reference and its forward's peak)
  and the whole step's peak within the peak model's tolerances of MemTracker's, where the planner without
  the row would be under by more;
- the row in --json and the explain table, the total and the fit decision including it, LoRA's 0 bytes (the
  base through disable_adapter()), and the option off leaving the estimate without the key; pp x zero=3
  (measured above the planner's count) refused;
- offloaded (`--reference offload`, boost_reference(offload=True)): on a GPU the policy's instants carry none
  of it (its peak at the backward is the one without a reference), the row is what its forward holds (the
  weights, and at zero 3 the padding, the root and the largest layer gathered), `reference_host` its host copy
  outside the total, the step's time has one host-to-device copy at host_bytes_s; on a CPU the host copy is
  device memory at every instant."""

from __future__ import annotations

import json
import os
import sys

import pytest

from meshboost.plan.__main__ import main

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,"
        "vocab_size=1000")


@pytest.mark.parametrize("fields", [dict(tp=2, precision="fp32"), dict(dp=2, zero=3, precision="bf16"),
                                    dict(pp=2, microbatches=2, precision="fp32")],
                         ids=["tp2-fp32", "dp2-zero3-bf16", "pp2-fp32"])
def test_reference_row_against_the_runtime(fields):
    from benchmarks.plan_cases import spec_of
    from benchmarks.plan_reference import measure, predict

    spec = spec_of("llama")
    low = -0.035 if fields["precision"] == "bf16" else -0.02       # test_peak.py's tolerances
    worst = {}
    for m in measure(spec, fields):
        p = predict(spec, fields, tuple(m["ranks"]))
        assert p["state"]["weights"] == m["weights"], (fields, m["ranks"])          # exact, every rank
        assert p["memory"]["reference"] == p["state"]["held"] > 0
        left = m["after"] - m["before"] - p["state"]["gathered"]       # the scored sums and counts besides
        assert 0 <= left < 16384, (fields, m["ranks"], m["after"] - m["before"], p["state"])
        instant = p["with"]["instants"]["reference"]
        err = (instant - m["reference_peak"]) / m["reference_peak"]
        assert low <= err <= 0.05, (fields, m["ranks"], instant, m["reference_peak"])
        stage = m["ranks"][0]                      # per stage its worst rank, as test_peak.py compares
        if stage not in worst or m["peak"] > worst[stage][0]:
            worst[stage] = (m["peak"], p["with"]["peak"], p["without"]["peak"])
    for stage, (measured, predicted, without) in worst.items():
        assert low <= (predicted - measured) / measured <= 0.05, (fields, stage, measured, predicted)
        assert (without - measured) / measured < low, (fields, stage, measured, without)    # the row matters


def _json(capsys, *argv) -> tuple[int, object]:
    try:
        code = main(["--model", "llama", "--set", TINY, "--gpus", "2", "--seq", "16", "--global-batch", "8",
                     "--device", "cpu", *argv])
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, (json.loads(out.out)[0] if "--json" in argv and code == 0 else out.out + out.err)


def test_row_in_the_estimate_and_the_fit(capsys):
    from meshboost.plan import plan
    from meshboost.plan.peak import needed_bytes
    from meshboost.plan.planner import GIB, MEMORY_KEYS

    _, off = _json(capsys, "--layout", "tp=2,zero=1", "--json")
    _, on = _json(capsys, "--layout", "tp=2,zero=1", "--json", "--reference")
    assert "reference" not in off["memory_bytes_per_rank"]
    mem = on["memory_bytes_per_rank"]
    # zero 1: the reference's tp shard in the working dtype, as the policy's own weights
    assert mem["reference"] == mem["weights"] > 0
    assert mem["total"] == sum(mem[k] for k in MEMORY_KEYS) + mem["reference"]
    assert mem["peak"] == off["memory_bytes_per_rank"]["peak"] + mem["reference"]    # at the backward
    assert any(n.startswith("reference: a frozen copy") for n in on["notes"])
    _, text = _json(capsys, "--layout", "tp=2,zero=1", "--reference")
    assert "reference" in text.splitlines()[1].split() and "reference 0.00" in text
    # the fit decision reads it: a memory between the two needs fits only without the reference
    keywords = dict(layout="tp=2,zero=1", gpus=2, seq=16, global_batch=8, device="cpu")
    overrides = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=1000)
    between = (needed_bytes(off["memory_bytes_per_rank"]) + needed_bytes(mem)) / 2 / GIB
    assert plan("llama", overrides, memory_gb=between, **keywords).fits
    assert not plan("llama", overrides, memory_gb=between, reference=True, **keywords).fits


def test_lora_reference_is_the_base(capsys):
    _, off = _json(capsys, "--layout", "dp=2,zero=1", "--json", "--lora-rank", "8")
    _, on = _json(capsys, "--layout", "dp=2,zero=1", "--json", "--lora-rank", "8", "--reference")
    assert on["memory_bytes_per_rank"]["reference"] == 0              # peft's disable_adapter(): no second copy
    assert any("disable_adapter" in n for n in on["notes"])
    # its forward still runs: the peak is at least the step's without it
    assert on["memory_bytes_per_rank"]["peak"] >= off["memory_bytes_per_rank"]["peak"]
    # pp x zero=3: measured above what the planner counts, refused (the ranking skips it), offloaded or not
    for layout, mode in (("pp=2,zero=3,microbatches=4", ()), ("pp=2,zero=3,microbatches=1", ("offload",))):
        code, err = _json(capsys, "--layout", layout, "--reference", *mode)
        assert code == 2 and "pp_size=2 x zero_stage=3 is not modelled yet" in err, err
        assert _json(capsys, "--layout", layout, "--json")[0] == 0     # without: planned



def _three(layout: str, device: str = "cuda") -> list:
    """The estimates of `layout` (the tiny Llama on 2 devices) without a reference, with one on the device, and
    with one offloaded to the host."""
    from meshboost.plan import plan

    overrides = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, vocab_size=1000)
    return [plan("llama", overrides, layout=layout, gpus=2, seq=16, global_batch=8, device=device, reference=mode)
            for mode in (None, True, "offload")]


@pytest.mark.parametrize("layout", ["tp=2,zero=1", "dp=2,zero=3", "pp=2,zero=1,microbatches=2"])
def test_offloaded_reference_row(layout):
    from meshboost.plan.cost import CostConstants

    off, on, away = _three(layout)
    assert "reference_host" not in on.memory_bytes_per_rank
    assert any("in host memory between uses" in n for n in away.notes)
    for stage_off, stage_on, stage in zip(off.per_stage, on.per_stage, away.per_stage):
        m_off, m_on, m = (s["memory_bytes"] for s in (stage_off, stage_on, stage))
        host, row, row_on = m["reference_host"], m["reference"], m_on["reference"]
        # between uses nothing of it is on the device: the policy's instants are the ones without a reference
        assert m_off["peak"] <= m["peak"] < m_on["peak"], (layout, m_off["peak"], m["peak"], m_on["peak"])
        if m["instant"] != "reference":
            assert m["peak"] == m_off["peak"], (layout, m["instant"])
        if "zero=1" in layout:        # its weights in the working dtype, as the policy's: the host copy, the row
            assert host == row == row_on == m["weights"] > 0, (layout, host, row, row_on, m["weights"])
        else:                         # FSDP2's fp32 shards and padding; on the device also what its forward gathers
            assert m["weights"] <= host < m["weights"] + 4096, (layout, host, m["weights"])
            assert row > row_on > host, (layout, row, row_on, host)
        assert m["total"] == m_on["total"] - row_on + row
        copies = stage["step_seconds_terms"]["reference_copies"]           # one host-to-device copy per step
        assert copies == pytest.approx(host / CostConstants().host_bytes_s, rel=1e-12) and copies > 0
        assert stage["step_seconds"] == pytest.approx(stage_on["step_seconds"] + copies, rel=1e-12)
    # on a CPU the host is the device: its copy counts at every instant of the policy's step
    off, _, away = _three("tp=2,zero=1", device="cpu")
    m_off, m = off.memory_bytes_per_rank, away.memory_bytes_per_rank
    if m["instant"] != "reference":
        assert m["peak"] == m_off["peak"] + m["reference_host"], (m_off["peak"], m["peak"], m["reference_host"])
