"""meshboost.plan.fakecache: a ranking whose fake runs were prefetched in worker processes is the ranking
made with every run in this process, byte for byte, and its recording pass found every run the ranking
then asked for (none is left to run here). A tiny Llama on 2 GPUs: every layout (tp, cp both modes,
split_gather, pp's body runs, checkpointing)."""

from __future__ import annotations

import multiprocessing

import pytest

from meshboost.plan import activations, fakecache
from meshboost.plan.__main__ import main

TINY = ("hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=4,num_key_value_heads=4,"
        "vocab_size=1000")


def _ranking(capsys, monkeypatch, workers: int) -> tuple[str, int]:
    """(the JSON ranking, the fake runs made in this process), every cache emptied first."""
    fakecache.clear()
    monkeypatch.setenv(fakecache.WORKERS_ENV, str(workers))
    runs = []
    saved_bytes = activations._saved_bytes

    def counted(*args, **kwargs):
        runs.append(args)
        return saved_bytes(*args, **kwargs)

    monkeypatch.setattr(activations, "_saved_bytes", counted)      # forked workers count in their own copy
    assert main(["--model", "llama", "--set", TINY, "--gpus", "2", "--seq", "16", "--global-batch", "2",
                 "--json"]) == 0
    monkeypatch.setattr(activations, "_saved_bytes", saved_bytes)
    return capsys.readouterr().out, len(runs)


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="workers are forked")
def test_prefetched_ranking_is_the_serial_one(capsys, monkeypatch):
    serial, serial_runs = _ranking(capsys, monkeypatch, 1)
    parallel, parallel_runs = _ranking(capsys, monkeypatch, 2)
    assert serial_runs > 10 and len(serial) > 1000
    assert parallel == serial
    assert parallel_runs == 0          # the recording pass found them all: none ran outside the workers


def test_workers_setting(monkeypatch):
    monkeypatch.setenv(fakecache.WORKERS_ENV, "3")
    assert fakecache.workers() == 3
    monkeypatch.setenv(fakecache.WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="MESHBOOST_PLAN_WORKERS='many'"):
        fakecache.workers()
