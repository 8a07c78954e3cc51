"""Multi-node launches, emulated with two torchrun "nodes" of 2 processes on loopback: static
(--node_rank, --master_addr/--master_port) and c10d rendezvous (--rdzv-backend c10d). Each trains
like one node of 4 processes, bitwise, with every tensor-parallel group inside one node (tp is the
innermost mesh axis). The commands are the ones docs/reliability.md shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from meshboost.testing import free_port

SCRIPT = Path(__file__).with_name("elastic_train.py")
RUN = [sys.executable, "-m", "torch.distributed.run"]


def _env():
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(key, None)
    return env


def _launch(tmp: Path, name: str, node_args: list[list[str]]) -> dict:
    """Start one torchrun per entry of `node_args` at once and wait for all of them."""
    script = [str(SCRIPT), "--ckpt", str(tmp / f"{name}-ckpt"), "--out", str(tmp / name)]
    procs = [subprocess.Popen(RUN + args + script, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, cwd=tmp) for args in node_args]
    for i, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{name} node {i}: torchrun failed (rc={proc.returncode}):\n{err[-4000:]}"
    return json.loads((tmp / f"{name}.attempt0").read_text())


def test_two_nodes_train_like_one(tmp_path):
    one = _launch(tmp_path, "one-node", [["--standalone", "--nproc_per_node", "4"]])
    port = free_port()
    static = _launch(tmp_path, "static", [["--nnodes", "2", "--nproc_per_node", "2", "--node_rank", str(n),
                                           "--master_addr", "127.0.0.1", "--master_port", str(port)]
                                          for n in (0, 1)])
    port = free_port()
    c10d = _launch(tmp_path, "c10d", [["--nnodes", "2", "--nproc_per_node", "2", "--rdzv-backend", "c10d",
                                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "meshboost-test"]
                                      for _ in (0, 1)])
    assert one["nodes"] == ["0"]
    for name, run in (("static", static), ("c10d", c10d)):
        assert run["nodes"] == ["0", "1"], f"{name}: {run['nodes']}"
        assert run["tp_within_node"], f"{name}: a tensor-parallel group spans two nodes"
        assert run["losses"] == one["losses"], f"{name}: {run['losses']} vs one node {one['losses']}"
