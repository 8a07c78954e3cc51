"""The planner outputs docs/planner.md shows are what their commands print (issue 56 item 10):
tools/doc_tables.py writes every block from the command in its marker; here its cheapest one (one 7B
layout explained) is printed again and compared, and every block's command is checked to name only
variables the doc sets. `python tools/doc_tables.py --check` compares them all (minutes: the rankings'
fake runs)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, os.fspath(ROOT / "tools"))

import doc_tables  # noqa: E402

DOC = ROOT / "docs" / "planner.md"


def test_every_block_names_a_command_the_doc_can_run():
    variables, blocks = doc_tables.find_blocks(DOC.read_text())
    assert len(blocks) >= 8 and {"S", "M"} <= set(variables)
    for block in blocks:
        argvs, _ = doc_tables._argvs(block.command, variables)
        for argv in argvs:
            assert "--model" in argv and not any("$" in arg for arg in argv), block.command
        assert block.body.strip(), f"{block.command}: empty block (run python tools/doc_tables.py)"


def test_an_explained_layout_is_what_its_command_prints():
    variables, blocks = doc_tables.find_blocks(DOC.read_text())
    (block,) = [b for b in blocks if "--layout tp=2,pp=2,zero=1,mb=32" in b.command]
    assert doc_tables.render(block, variables) == block.body
