"""The table run.sh prints: each run's per-step training loss (what record_losses.py saw) against the same
script on one process (`<script>-zero2-1`), as the largest relative difference over the steps.

    python compare.py <losses folder>
"""

import json
import sys
from pathlib import Path


def steps(prefix: Path) -> list[float]:
    """The run's per-step `train/loss`: the TensorBoard scalars of the rank that wrote them (rank 0), else the
    progress bar of the last rank that shows one (a pipeline's last stage)."""
    files = sorted(prefix.parent.glob(prefix.name + ".*"), key=lambda f: int(f.suffix[1:]))
    ranks = [[json.loads(line) for line in open(f)] for f in files]
    for rows in ranks:
        scalars = [r["value"] for r in rows if r["source"] == "scalar" and r["tag"] == "train/loss"]
        if scalars:
            return scalars
    for rows in reversed(ranks):
        shown = [r["train/loss"] for r in rows if r["source"] == "postfix" and "train/loss" in r]
        if shown:
            return shown
    return []


def main(folder: Path) -> None:
    names = sorted({p.name.rsplit(".", 1)[0] for p in folder.iterdir()})
    print("| script | plugin | processes | steps | first loss | last loss | max abs. diff vs 1 process "
          "| max rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        script, plugin, n = name.rsplit("-", 2)
        mine, ref = steps(folder / name), steps(folder / f"{script}-zero2-1")
        if not mine:
            print(f"| {script} | {plugin} | {n} | 0 | | | no loss recorded |")
            continue
        if n == "1" and plugin == "zero2":
            diff = "(the reference) | "
        elif len(ref) != len(mine):
            diff = f"steps differ ({len(mine)} vs {len(ref)}) | "
        else:
            diff = (f"{max(abs(a - b) for a, b in zip(mine, ref)):.1e} | "
                    f"{max(abs(a - b) / abs(b) for a, b in zip(mine, ref)):.1e}")
        print(f"| {script} | {plugin} | {n} | {len(mine)} | {mine[0]:.5f} | {mine[-1]:.5f} | {diff} |")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
