"""The README's first snippet is examples/quickstart/train.py, whole (issue 43: the snippet once used
`torch`, `transformers`, `path`, `train_ds` and `lr_scheduler` without defining them). The README's
first python block must be the script below its docstring, line for line, and the script must run as
torchrun would run it (2 processes, tp=2, the spawn helper's process group) and train: both tensor-parallel
ranks see the same loss stream, which falls."""

import runpy
from pathlib import Path

import torch.distributed as dist

from meshboost.testing import spawn

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "quickstart" / "train.py"


def test_readme_snippet_is_the_quickstart_script():
    readme = (ROOT / "README.md").read_text()
    start = readme.index("```python\n") + len("```python\n")
    snippet = readme[start:readme.index("```", start)]
    script = SCRIPT.read_text()
    body = script[script.index('"""\n', 3) + 4:]           # below the module docstring
    assert snippet == body, "README's first snippet differs from examples/quickstart/train.py"


def _run(rank: int, world: int) -> None:
    losses = runpy.run_path(str(SCRIPT), run_name="__main__")["losses"]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0, losses
    everyone = [None] * world
    dist.all_gather_object(everyone, losses)
    assert everyone[0] == everyone[1], "the tp ranks saw different losses"


def test_quickstart_trains_at_tp2():
    spawn(_run, 2)
