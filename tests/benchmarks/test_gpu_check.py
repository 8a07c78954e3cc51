"""`benchmarks/gpu_check.sh --dry-run` (issue 15, item 4) runs on a machine without a GPU: every step
parses and runs (the CUDA tests skip, the MFU script trains a tiny Llama on CPU through every row of issue
41's table, plain PyTorch, meshboost eager, + compile, + compile + float8, and prints each row's line, the
planner's CUDA comparison calibrates its cost constants on the machine, runs its cases shrunk on CPU and prints
its pred.peak / meas.peak and pred.s / meas.s table, the step times predicted from those constants)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run():
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry-run"], capture_output=True,
                          text=True, timeout=420, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    rows = [f"gpu_mfu row: tiny {row} " for row in ("plain_autocast", "plain_bf16", "meshboost", "compile",
                                                    "compile_float8")]
    for line in ("1/5 packages", "2/5 CUDA tests", "3/5 tensor parallelism", *rows, "5/5 planner",
                 "cost constants: calibrated on cpu", "pred.peak", "pred.s", "done"):
        assert line in out, (line, out[-3000:])
