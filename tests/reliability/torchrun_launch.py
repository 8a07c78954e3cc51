"""torchrun launches of elastic_train.py for the restart and multi-node tests (conftest.py shares
the uninterrupted one-node run between them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("elastic_train.py")
RUN = [sys.executable, "-m", "torch.distributed.run"]


def torchrun_env() -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(key, None)
    return env


def launch(tmp: Path, name: str, node_args: list[list[str]], extra: list[str] = ()) -> dict:
    """Start one torchrun per entry of `node_args` (the launcher's own flags) at once, each running
    elastic_train.py with `extra`, wait for all; {".attemptN": that attempt's record} of every attempt
    that finished."""
    script = [str(SCRIPT), "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(tmp / name), *extra]
    procs = [subprocess.Popen(RUN + args + script, env=torchrun_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp) for args in node_args]
    for i, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} node {i}: torchrun failed (rc={proc.returncode}):\n{err[-4000:]}"
    attempts = sorted(tmp.glob(f"{name}.attempt*"))
    assert attempts, f"{name}: no attempt finished"
    return {p.suffix: json.loads(p.read_text()) for p in attempts}


ONE_NODE = ["--standalone", "--nproc_per_node", "4", "--max-restarts", "1", "--monitor-interval", "1"]
