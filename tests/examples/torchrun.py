"""Running an example script as its users do, for the example tests: under torchrun (or plain python) in a fresh
process, offline, with this checkout's meshboost first on the path and no launcher variables inherited from the
calling process; and the skip of a test module whose optional example data is not installed.
Not a test module: the example tests import it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def example_env() -> dict:
    """The environment of an example run: offline, unbuffered, this checkout on PYTHONPATH, no RANK /
    WORLD_SIZE / LOCAL_RANK from the caller (torchrun sets its own)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    return env


def run_example(script: Path, *args: str, nproc: int | None, cwd: Path | None = None, timeout: float = 300,
                ) -> subprocess.CompletedProcess:
    """`script` with `args` under torchrun on `nproc` processes (None: plain python, no launcher), in `cwd`
    (None: this process's); stdout and stderr captured as text. The caller checks the exit status."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else []
    cmd = [sys.executable, *launcher, str(script), *args]
    return subprocess.run(cmd, env=example_env(), capture_output=True, text=True, timeout=timeout, cwd=cwd)


def failure(proc: subprocess.CompletedProcess, what: str | None = None) -> str:
    """The assertion message of a run that should have succeeded: `what` (by default its command line), its
    exit status and the end of its output."""
    what = what or " ".join(map(str, proc.args))
    return f"{what} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"


def skip_without_example_data(probe, error: type[Exception]):
    """An autouse fixture skipping every test of the module when `probe()` raises `error`: the offline weights,
    tokenizer and corpora are optional extras (requirements-examples-nodeps.txt)."""
    @pytest.fixture(autouse=True)
    def _example_data_installed():
        try:
            probe()
        except error as e:
            pytest.skip(f"example data not installed: {e}")
    return _example_data_installed
