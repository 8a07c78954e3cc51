"""How long the planner's documented examples take: each command of docs/planner.md's generated blocks
(tools/doc_tables.py's markers) run as `python -m meshboost.plan ...` in a fresh process, its wall
seconds and the CPU seconds (user + sys) of it and its worker processes.

    python benchmarks/plan_speed.py                          # every documented example, this checkout
    python benchmarks/plan_speed.py --only "--gpus 8 " --compare /work/main    # beside another checkout
    python benchmarks/plan_speed.py --repeat 3               # each command 3 times, alternating
    python benchmarks/plan_speed.py --extra "--device cpu"   # every command with these arguments too

`--compare PATH` runs each command on this checkout and on PATH's (its meshboost imported instead)
back to back, alternating, so that background load falls on both alike; CUDA is hidden from every
run (the doc's outputs are the cost defaults' on any machine). Prints one row per command and
checkout: wall and CPU seconds (the median over the repeats), and whether the stdout matched the
first checkout's.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.fspath(ROOT / "tools"))


def commands(only: str | None = None) -> list[list[str]]:
    """The planner argument lists of docs/planner.md's generated blocks (each `;;` part its own)."""
    import doc_tables

    out = []
    for path in doc_tables.DOCS:
        variables, blocks = doc_tables.find_blocks(path.read_text())
        for block in blocks:
            argvs, _ = doc_tables._argvs(block.command, variables)
            out += [argv for argv in argvs if only is None or only in " ".join(argv)]
    return out


def timed(argv: list[str], checkout: Path) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds of the process and its workers, stdout) of one planner command."""
    env = {**os.environ, "PYTHONPATH": os.fspath(checkout), "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "meshboost.plan", *argv], cwd=checkout, env=env,
                          capture_output=True, text=True)
    wall = time.monotonic() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, done.stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="the commands holding this text")
    parser.add_argument("--compare", default=None, metavar="PATH", help="another checkout to time beside this one")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--extra", default="", help="arguments added to every command (--device cpu: the peak "
                        "both checkouts predicted by default on a machine without a GPU before 2026-12-07)")
    args = parser.parse_args(argv)
    checkouts = [ROOT] + ([Path(args.compare).resolve()] if args.compare else [])
    print(f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; CUDA hidden; wall and CPU (user + sys) seconds, "
          f"median of {args.repeat}")
    for argv in commands(args.only):
        argv = argv + args.extra.split()
        runs = {c: [] for c in checkouts}
        for _ in range(args.repeat):
            for checkout in checkouts:
                runs[checkout].append(timed(argv, checkout))
        first = runs[checkouts[0]][0][2]
        print(" ".join(argv)[:150])
        for checkout in checkouts:
            walls, cpus = [r[0] for r in runs[checkout]], [r[1] for r in runs[checkout]]
            same = "same output" if runs[checkout][0][2] == first else "other output"
            print(f"  {os.fspath(checkout):30s} wall {statistics.median(walls):7.1f} s  cpu "
                  f"{statistics.median(cpus):7.1f} s  {same}")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
