"""Every ```python block of docs/*.md and README.md runs as written (issue 56 item 10: docs/compile.md's first
block raised NameError: ZeroConfig; nothing ran the docs' blocks but the README's first).

How a block runs is said by an HTML comment on the line above its fence, so nothing is skipped silently:
- no comment: it runs here, in this process, with no process group (pure configuration);
- `<!-- doc-block: world=N -->`: it runs on every rank of an N-process group (the smallest world its layout
  needs); `given=a,b` adds names this test builds first (GIVEN below: a tiny model and what goes with it),
  `given=model:qwen3_moe` a tiny model of that family. Every block of one world runs in one spawn, each in a
  fresh namespace, in a fresh shared folder (relative checkpoint paths land there);
- `<!-- doc-block: fragment, <reason> -->`: compiled only (a syntax error still fails), with its reason;
- `<!-- doc-block: tested-by <path> -->`: another test runs it whole (that file must exist and name the doc).
A comment this test cannot read fails, and so does a block whose comment is missing and that needs a group.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
MARK = re.compile(r"<!--\s*doc-block:\s*(.*?)\s*-->")


@dataclass
class Block:
    doc: str             # path relative to the repository
    line: int            # the fence's line, 1-based
    code: str
    kind: str = "local"  # local | world | fragment | tested-by
    world: int = 1
    given: dict = field(default_factory=dict)      # name -> variant ("" for the default)
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def _parse_mark(text: str, block: Block) -> None:
    head, _, rest = text.partition(",")
    head = head.strip()
    if head == "fragment":
        block.kind, block.reason = "fragment", rest.strip()
        assert block.reason, f"{block.where}: a fragment says why (<!-- doc-block: fragment, reason -->)"
        return
    if head.startswith("tested-by "):
        block.kind, block.reason = "tested-by", head.split(None, 1)[1]
        return
    for item in text.split():             # "world=4 given=model,optimizer"
        key, _, value = item.partition("=")
        if key == "world":
            block.kind, block.world = "world", int(value)
        elif key == "given":
            for name in value.split(","):
                name, _, variant = name.partition(":")
                block.given[name] = variant
        else:
            raise AssertionError(f"{block.where}: unreadable doc-block comment {text!r}")
    assert block.kind == "world" or not block.given, f"{block.where}: given= needs world=N"


def doc_blocks() -> list[Block]:
    blocks = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":           # indented inside a list item too
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
                code = textwrap.dedent("\n".join(lines[i + 1:end]) + "\n")
                block = Block(str(path.relative_to(ROOT)), i + 1, code)
                above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
                mark = MARK.search(above)
                if mark:
                    _parse_mark(mark.group(1), block)
                blocks.append(block)
                i = end
            i += 1
    return blocks


BLOCKS = doc_blocks()
WORLDS = sorted({b.world for b in BLOCKS if b.kind == "world"})


# -- the names a block may take from the test (given=...) -------------------------------------------------

def _given(names: dict) -> dict:
    """Fresh values for `names`, built in dependency order (the model before its optimizer). Tiny and seeded:
    the same on every rank."""
    import torch

    from meshboost import Booster
    from meshboost.plugins import HybridParallelPlugin
    from meshboost.testing.models import VOCAB, build_model, tiny_config
    ns: dict = {}
    family = names.get("model") or names.get("config") or "llama"
    if family == "qwen3_moe":
        from meshboost.testing.moe import build_causal_lm, moe_config
        config = moe_config("qwen3_moe")
        model = build_causal_lm(config) if "model" in names else None
    else:                                   # 4 layers: two stages of two chunks each have a layer
        config = tiny_config(family, num_hidden_layers=4)
        model = build_model("LlamaForCausalLM", config) if "model" in names else None
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(1, VOCAB, (16, 16), generator=g)
    values = {
        "config": lambda: config,
        "model": lambda: model,
        "optimizer": lambda: torch.optim.AdamW(model.parameters(), lr=1e-3),
        "criterion": lambda: (lambda outputs, inputs: outputs.loss),
        "lr_scheduler": lambda: torch.optim.lr_scheduler.LambdaLR(ns["optimizer"], lambda step: 1.0),
        "dataset": lambda: [{"input_ids": r, "labels": r} for r in rows],
        "batch": lambda: {"input_ids": rows[:4, :8], "labels": rows[:4, :8]},
        "booster": lambda: Booster(plugin=HybridParallelPlugin(tp_size=2)),
        "total_steps": lambda: 2,
    }
    for name in values:                       # the table's order is the dependency order
        if name in names:
            ns[name] = values[name]()
    unknown = set(names) - set(values)
    assert not unknown, f"given= names this test does not build: {sorted(unknown)}; known: {sorted(values)}"
    return ns


def _run(block: Block, folder: Path) -> None:
    import os
    folder.mkdir(parents=True, exist_ok=True)
    here = os.getcwd()
    os.chdir(folder)
    try:
        ns = {"__name__": "__doc_block__", **_given(block.given)}
        exec(compile(block.code, block.where, "exec"), ns)
    except Exception as e:
        raise AssertionError(f"{block.where} failed: {type(e).__name__}: {e}") from e
    finally:
        os.chdir(here)


def _world_body(rank: int, world: int, blocks: list[Block], folder: str) -> None:
    for i, block in enumerate(blocks):
        _run(block, Path(folder) / f"block{i}")


# -- the tests -----------------------------------------------------------------------------------------------

def test_every_block_is_marked_or_runs_here():
    assert len(BLOCKS) >= 20, [b.where for b in BLOCKS]
    for b in BLOCKS:
        compile(b.code, b.where, "exec")                   # fragments too: a syntax error fails
        if b.kind == "tested-by":
            test = ROOT / b.reason
            assert test.is_file() and Path(b.doc).name in test.read_text(), \
                f"{b.where}: tested-by {b.reason}, which does not exist or does not name {b.doc}"


def test_blocks_without_a_group(tmp_path):
    for i, block in enumerate(b for b in BLOCKS if b.kind == "local"):
        _run(block, tmp_path / f"block{i}")


@pytest.mark.parametrize("world", WORLDS)
def test_blocks_at_their_world(world, tmp_path):
    from meshboost.testing import spawn
    spawn(_world_body, world, [b for b in BLOCKS if b.kind == "world" and b.world == world], str(tmp_path))
