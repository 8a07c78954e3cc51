"""The benchmark at a tiny size, every configuration of `benchmarks/train_step.py` for one step (one
process group per world size: 1, 2 and 4 processes), so a release that breaks a configuration (the
DTensor peer included) fails here: every row runs and trains the unsharded model's function (its first
loss equals the single-process reference), meshboost's communication counter equals the Megatron
formula exactly at tp=2 (calls and bytes, forward+backward), the dispatcher witness sees the same
collectives, tp=2's all-reduces cross gloo's sockets (the bytes written there are the ring bytes counted),
and every row reports its time in collectives."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository root: `benchmarks`

from benchmarks.models import ModelSpec, build_model, make_batch  # noqa: E402
from benchmarks.runners import CONFIGS                            # noqa: E402
from benchmarks.theory import tp_comm_theory                      # noqa: E402
from benchmarks.train_step import format_summary, format_table, run_models  # noqa: E402

SPECS = [ModelSpec(family="gpt2", layers=2, hidden=32, heads=4, seq=8, batch=4, vocab=101),
         ModelSpec(family="llama", layers=3, hidden=32, heads=4, seq=8, batch=4, vocab=101),
         ModelSpec(family="bert", layers=2, hidden=32, heads=4, seq=8, batch=4, vocab=101)]


def _check_megatron_formula(spec: ModelSpec, record: dict) -> None:
    where = spec.family
    theory = tp_comm_theory(spec, tp=2)
    # Hand-derived for these sizes (fp32): per layer 4 all-reduces of b*s*h, embedding 1,
    # causal LM: head 1 + cross-entropy MAX (b*s) and stacked SUMs (2*b*s).
    b, s, h, L = spec.batch, spec.seq, spec.hidden, spec.layers
    expected_calls = 4 * L + 1 + (3 if spec.causal_lm else 0)
    expected_bytes = 4 * ((4 * L + 1) * b * s * h + ((b * s * h + 3 * b * s) if spec.causal_lm else 0))
    assert (theory["calls"], theory["payload_bytes"]) == (expected_calls, expected_bytes), where
    counted = record["comm_fwd_bwd"]
    assert set(counted) == {"tp"}, f"{where}: collectives outside tp in forward+backward: {counted}"
    assert counted["tp"]["calls"] == expected_calls, f"{where}: {counted['tp']}"
    assert counted["tp"]["by_op"] == {"all_reduce": expected_calls}, f"{where}: {counted['tp']}"
    assert counted["tp"]["payload_bytes"] == expected_bytes, f"{where}: {counted['tp']}"
    # Ring cost at P=2 is 2(P-1)/P = 1 times the payload: exactly the formula, no tolerance.
    assert record["tp_bytes_ratio"] == 1.0 and record["tp_calls_ratio"] == 1.0, where
    assert record["witness_fwd_bwd"] == counted, f"{where}: a collective bypassed record_collective"
    # Memory: each rank holds its shard (plus replicated norms/biases), AdamW keeps 2 moments.
    mem = record["memory"]
    assert mem["grads"] == mem["weights"] and mem["optimizer_states"] == 2 * mem["weights"], where
    full = sum(p.numel() * 4 for p in build_model(spec).parameters())
    assert full / 2 < mem["weights"] < full, where


def _check_only_buffer_broadcasts_bypass(record: dict, where: str) -> None:
    counted, witness = record["comm_fwd_bwd"], record["witness_fwd_bwd"]
    assert set(counted) == set(witness) and counted["tp"] == witness["tp"], where
    extra = {op: n - counted["dp"]["by_op"].get(op, 0) for op, n in witness["dp"]["by_op"].items()}
    assert {op for op, n in extra.items() if n} <= {"broadcast"}, (where, counted, witness)


def test_every_configuration_runs_and_tp2_matches_megatron_formula():
    keys = list(CONFIGS)
    for spec, records in zip(SPECS, run_models(SPECS, keys, warmup=1, steps=1)):
        where = spec.family
        ref = build_model(spec)
        with torch.no_grad():
            ref_loss = ref(**make_batch(spec)).loss.item()
        by_key = {r["key"]: r for r in records}
        assert set(by_key) == set(keys), where
        for key, r in by_key.items():
            assert not r.get("skipped"), f"{where} {key}: {r['skipped']}"
            assert r["steps_timed"] == 1 and r["step_ms_median"] > 0, (where, key)
            # every configuration, DTensor's included, trains the same function from the same weights
            assert abs(r["loss0"] - ref_loss) < 1e-4, f"{where} {key}: loss {r['loss0']} vs {ref_loss}"
            if key == "dp2":     # torch DDP broadcasts the model's buffers itself, outside record_collective
                _check_only_buffer_broadcasts_bypass(r, where)
            else:
                assert r["witness_agrees"], f"{where} {key}: a collective bypassed record_collective"
            assert r["wait_blocked_ms_median"] >= 0 and r["wait_overlapped_ms_median"] >= 0, (where, key)
        _check_megatron_formula(spec, by_key["tp2"])
        # DTensor's traffic is read by the dispatcher witness; its time in collectives by the dispatcher clock
        dtensor = by_key["dtensor"]
        assert dtensor["comm_source"] == "dispatcher" and dtensor["comm_fwd_bwd"]["tp"]["calls"] > 0, where
        assert dtensor["wait_source"].startswith("dispatcher") and dtensor["wait_blocked_ms_median"] > 0, where
        # tp=2 waits for its collectives (forward all-reduces are synchronous); plain ones have none
        assert by_key["tp2"]["wait_blocked_ms_median"] > 0, where
        assert by_key["plain"]["wait_blocked_ms_median"] == 0 == by_key["plain2"]["wait_blocked_ms_median"], where
        assert by_key["tp2"]["vs_plain_paired"] and by_key["tp2"]["vs_dtensor_paired"], where
        # a third witness: tp=2's all-reduces put (at least) the ring bytes counted on gloo's sockets
        assert by_key["tp2"]["wire_over_ring"] > 0.9, where
        table, summary = format_table(records), format_summary(records)
        assert "DTensor tp=2" in table and "1.0000" in table, table
        assert "meshboost tp=2 / DTensor tp=2" in summary and "plain (same group)" in summary, summary
