"""Runs colossalai_style_finetune.py under torchrun (2 processes) and returns its RESULT line."""

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "colossalai_style_finetune.py"
FAST = ["--epochs", "2", "--lr", "1e-2"]


def run_finetune(*args: str, timeout: int = 120) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(SCRIPT),
           *args, *FAST, "--target_accuracy", "0.75"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0][len("RESULT "):])


def check_trained(result: dict, dp_size: int, steps: int) -> None:
    assert result["samples"] == 64 and result["dp_size"] == dp_size and result["steps"] == steps
    assert result["last_loss"] < 0.5 * result["first_loss"], result
    assert result["accuracy"] >= 0.75 and 0.0 <= result["f1"] <= 1.0, result
