"""The benchmark machinery at a tiny size: meshboost's communication counter must equal the
Megatron formula exactly (calls and bytes, forward+backward), the dispatcher witness must see the
same collectives, and the tp=2 loss must equal the unsharded single-process model's."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))     # the repository root: `benchmarks`

from benchmarks.harness import run_group                          # noqa: E402
from benchmarks.models import ModelSpec, build_model, make_batch  # noqa: E402
from benchmarks.theory import tp_comm_theory                      # noqa: E402
from benchmarks.train_step import add_ratios, format_table, merge  # noqa: E402
from benchmarks.runners import CONFIGS                            # noqa: E402
from meshboost.testing import spawn                               # noqa: E402

SPECS = [ModelSpec(family="gpt2", layers=2, hidden=32, heads=4, seq=8, batch=4, vocab=101),
         ModelSpec(family="llama", layers=3, hidden=32, heads=4, seq=8, batch=2, vocab=101),
         ModelSpec(family="bert", layers=2, hidden=32, heads=4, seq=8, batch=4, vocab=101)]


def _body(rank: int, world_size: int) -> None:
    for spec in SPECS:
        results = run_group(["tp2"], spec, warmup=1, steps=1)["tp2"]
        everyone = [None] * world_size
        dist.all_gather_object(everyone, results)
        record = merge(spec, CONFIGS["tp2"], everyone)
        add_ratios([record])
        where = spec.family
        theory = tp_comm_theory(spec, tp=2)
        # Hand-derived for these sizes (fp32): per layer 4 all-reduces of b*s*h, embedding 1,
        # causal LM: head 1 + cross-entropy MAX (b*s) and stacked SUMs (2*b*s).
        b, s, h, L = spec.batch, spec.seq, spec.hidden, spec.layers
        expected_calls = 4 * L + 1 + (3 if spec.causal_lm else 0)
        expected_bytes = 4 * ((4 * L + 1) * b * s * h + ((b * s * h + 3 * b * s) if spec.causal_lm else 0))
        assert (theory["calls"], theory["payload_bytes"]) == (expected_calls, expected_bytes), where
        counted = results["fwd_bwd"]["comm"]
        assert set(counted) == {"tp"}, f"{where}: collectives outside tp in forward+backward: {counted}"
        assert counted["tp"]["calls"] == expected_calls, f"{where}: {counted['tp']}"
        assert counted["tp"]["by_op"] == {"all_reduce": expected_calls}, f"{where}: {counted['tp']}"
        assert counted["tp"]["payload_bytes"] == expected_bytes, f"{where}: {counted['tp']}"
        # Ring cost at P=2 is 2(P-1)/P = 1 times the payload: exactly the formula, no tolerance.
        assert record["tp_bytes_ratio"] == 1.0 and record["tp_calls_ratio"] == 1.0, where
        assert results["fwd_bwd"]["witness"] == counted, f"{where}: a collective bypassed record_collective"
        # Memory: each rank holds its shard (plus replicated norms/biases), AdamW keeps 2 moments.
        mem = results["memory"]
        assert mem["grads"] == mem["weights"] and mem["optimizer_states"] == 2 * mem["weights"], where
        full = sum(p.numel() * 4 for p in build_model(spec).parameters())
        assert full / 2 < mem["weights"] < full, where
        # The unsharded single-process reference: same weights and batch, same first loss.
        ref = build_model(spec)
        with torch.no_grad():
            ref_loss = ref(**make_batch(spec)).loss.item()
        assert abs(record["loss0"] - ref_loss) < 1e-5, f"{where}: loss {record['loss0']} vs {ref_loss}"
        if rank == 0:
            table = format_table([record])
            assert "meshboost tp=2" in table and "1.0000" in table, table


def test_comm_counter_matches_megatron_formula():
    spawn(_body, 2)
