"""Write the outputs of `python -m meshboost.plan` that a doc shows from the commands themselves.

    python tools/doc_tables.py                 # rewrite every block of docs/planner.md from its command
    python tools/doc_tables.py --check         # exit 1 (and name them) where a block differs
    python tools/doc_tables.py --only layout   # the blocks whose command holds this text

A block is a fenced code block between two markers; the first holds the planner's arguments:

    <!-- plan-output: --model llama --set $S --gpus 8 --seq 4096 --global-batch 256 --top 8 -->
    ```
    (what the command prints on stdout)
    ```
    <!-- /plan-output -->

`$NAME` is a doc variable, set once by `<!-- plan-var NAME=value -->` (the model overrides a doc's
shell block sets, spelled out); `;;` separates commands whose outputs follow each other in one block,
and a trailing `| grep REGEX` keeps the lines of their outputs that match. Each command runs in this
process (`meshboost.plan.__main__.main`) with CUDA hidden, so a block reads the same on every machine:
the cost constants are the defaults (a GPU would choose its own) and the peak the `--device` asked for
(cuda, the default); a command that finds no layout fitting shows its advice and its error line.
`find_blocks` and `render` are what tests/plan/test_doc_tables.py calls.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DOCS = (ROOT / "docs" / "planner.md",)
VAR = re.compile(r"<!-- plan-var (\w+)=(\S+) -->")
BLOCK = re.compile(r"(<!-- plan-output: (?P<command>.+?) -->\n```\n)(?P<body>.*?)(```\n<!-- /plan-output -->)", re.S)


@dataclass(frozen=True)
class Block:
    """One generated block of a doc: its marker's command text, the body the doc holds, where it is."""

    command: str
    body: str
    span: tuple[int, int]           # of the body in the doc's text


def find_blocks(text: str) -> tuple[dict, list[Block]]:
    """({variable: value}, [Block]) of a doc's text."""
    variables = dict(VAR.findall(text))
    blocks = [Block(m["command"], m["body"], m.span("body")) for m in BLOCK.finditer(text)]
    return variables, blocks


def _argvs(command: str, variables: dict) -> tuple[list[list[str]], str | None]:
    """The argument lists of a marker's commands and its grep pattern (None: every line)."""
    pattern = None
    if " | grep " in command:
        command, pattern = command.split(" | grep ", 1)
    expanded = re.sub(r"\$(\w+)", lambda m: variables[m.group(1)], command)
    return [shlex.split(part) for part in expanded.split(";;")], pattern


def run(argv: list[str]) -> str:
    """What `python -m meshboost.plan ARGV` prints on stdout, CUDA hidden, and its error line when it
    exits with one (no layout fits: the advice, then the error); its progress lines are left out."""
    from meshboost.plan.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with mock.patch("torch.cuda.is_available", return_value=False), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(err):
        try:
            main(argv)
        except SystemExit as exc:
            if exc.code in (None, 0):
                raise
            errors = [line for line in err.getvalue().splitlines() if line.startswith("meshboost.plan: error")]
            if not errors:
                raise RuntimeError(f"python -m meshboost.plan {shlex.join(argv)} exited {exc.code}: "
                                   f"{err.getvalue()}") from None
            out.write("\n".join(errors) + "\n")
    return out.getvalue()


def render(block: Block, variables: dict) -> str:
    """The body `block`'s commands print now."""
    argvs, pattern = _argvs(block.command, variables)
    lines = [line for argv in argvs for line in run(argv).splitlines()]
    if pattern is not None:
        lines = [line for line in lines if re.search(pattern, line)]
    return "".join(line.rstrip() + "\n" for line in lines)


def update(path: Path, only: str | None = None, check: bool = False) -> list[str]:
    """Rewrite (or with `check` only compare) the blocks of `path`; the commands of those that differed."""
    text = path.read_text()
    variables, blocks = find_blocks(text)
    changed, pieces, last = [], [], 0
    for block in blocks:
        body = block.body
        if only is None or only in block.command:
            body = render(block, variables)
            if body != block.body:
                changed.append(block.command)
        pieces += [text[last:block.span[0]], body]
        last = block.span[1]
    if changed and not check:
        path.write_text("".join(pieces) + text[last:])
    return changed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 where a block differs")
    parser.add_argument("--only", default=None, help="the blocks whose command holds this text")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    failed = False
    for path in DOCS:
        changed = update(path, args.only, args.check)
        for command in changed:
            print(f"{path.relative_to(ROOT)}: {'differs' if args.check else 'rewritten'}: {command}")
        failed |= bool(changed) and args.check
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
