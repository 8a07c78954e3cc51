"""Elastic restart: under `torchrun --max-restarts 1`, a rank killed mid-run (SIGKILL at step 5) makes
torchrun restart every worker; the script's booster.load_checkpoint resumes from the last committed
step (4), and the per-step losses of the restarted attempt equal the uninterrupted run's bitwise, for
a tied (GPT-2, fp16) and an untied (Llama, fp32) LM head, at tp=2 x dp=2 with ZeRO-1.
(torch's default restart reuses the agent's TCP store and would meet the dead attempt's keys:
launch_from_torch gives each attempt its own prefix.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("elastic_train.py")


def _torchrun(tmp: Path, name: str, extra: list[str]) -> dict:
    out = tmp / name
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           "--max-restarts", "1", "--monitor-interval", "1", str(SCRIPT), "--ckpt", str(tmp / f"{name}-ckpt"),
           "--out", str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp)
    assert proc.returncode == 0, f"{name}: torchrun failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}"
    attempts = sorted(tmp.glob(f"{name}.attempt*"))
    assert attempts, f"{name}: no attempt finished"
    return {p.suffix: json.loads(p.read_text()) for p in attempts}


# Each factor once (tied/untied head x fp32/fp16 crossed): every restart costs ~50 s of the suite.
@pytest.mark.parametrize("family,precision", [("llama", "fp32"), ("gpt2", "fp16")])
def test_killed_rank_resumes_exactly(tmp_path, family, precision):
    common = ["--family", family, "--precision", precision]
    clean = _torchrun(tmp_path, "clean", common)
    assert list(clean) == [".attempt0"], clean
    expected = clean[".attempt0"]["losses"]
    killed = _torchrun(tmp_path, "killed", common + ["--kill-rank", "3", "--kill-at", "5"])
    assert list(killed) == [".attempt1"], f"the first attempt must die and the second finish: {list(killed)}"
    resumed = killed[".attempt1"]
    assert resumed["first_step"] == 5, resumed       # steps 1-4 committed before the kill
    assert resumed["losses"] == {k: v for k, v in expected.items() if int(k) >= 5}, \
        f"{family} {precision}: resumed {resumed['losses']} vs uninterrupted {expected}"
