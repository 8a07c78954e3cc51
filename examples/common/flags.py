"""The command line every example shares: a parser that speaks once per launch, and the checks that turn a
bad flag value into one line naming the flag (exit code 2 on every rank), before any collective.

Owns: the argparse parser whose usage, errors and help only rank 0 prints (torchrun starts the script once
per process: a typo would print its usage once per rank), number ranges given as a table, files and
folders that must exist, the folder outputs go to, and model sources (an HF folder or a hub id: a value
that is neither is refused here instead of as huggingface_hub's "Repo id must be in the form ..." traceback).
Pure and cheap: no torch or transformers import, no collective; every rank reaches the same verdict.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from common.train_loop import UsageError


class Parser(argparse.ArgumentParser):
    """argparse's parser, quiet on every rank but 0 (each rank still exits 2 on a bad flag)."""

    def _print_message(self, message, file=None):
        if int(os.environ.get("RANK", "0")) == 0:
            super()._print_message(message, file)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# the rules of a flags table: (test, what a good value is)
AT_LEAST_1 = (lambda v: _number(v) and v >= 1, ">= 1")
NON_NEGATIVE = (lambda v: _number(v) and v >= 0, "a finite number >= 0")
POSITIVE = (lambda v: _number(v) and v > 0, "a finite number > 0")
FRACTION = (lambda v: _number(v) and 0 <= v <= 1, "between 0 and 1")
DROPOUT = (lambda v: _number(v) and 0 <= v < 1, ">= 0 and < 1")


def rule(rule_: tuple, what: str) -> tuple:
    """`rule_` with its own words (`rule(NON_NEGATIVE, ">= 0 (0: the epochs' steps)")`)."""
    return rule_[0], what


# the loop's flags that 0 switches off, as the training scripts spell them
LOOP_NUMBERS = {
    "stop_after": rule(NON_NEGATIVE, ">= 1 (or 0: run every step)"),
    "save_every": rule(NON_NEGATIVE, ">= 1 (or 0: no checkpoints)"),
    "max_grad_norm": rule(NON_NEGATIVE, "a finite number >= 0 (0: no clipping)"),
}


def check_numbers(args: argparse.Namespace, rules: dict, spell) -> None:
    """UsageError naming the first flag whose value (not None) breaks its rule; `spell(dest)` is the flag."""
    for dest, (ok, what) in rules.items():
        value = getattr(args, dest)
        if value is not None and not ok(value):
            raise UsageError(f"{spell(dest)}={value} must be {what}")


def add_lora_flags(arg, lora_help: str) -> None:
    """--lora (its help: `lora_help`), --lora-r, --lora-alpha, --lora-targets, declared through `arg(name, **kw)`."""
    arg("--lora", action="store_true", help=lora_help)
    arg("--lora-r", type=int, default=8)
    arg("--lora-alpha", type=int, default=16)
    arg("--lora-targets", default="q_proj,k_proj,v_proj,o_proj")


def check_lora_targets(args: argparse.Namespace, spell, example: str) -> None:
    """With --lora, --lora-targets must name at least one module (`example`: what to pass instead)."""
    if args.lora and not [t for t in args.lora_targets.split(",") if t]:
        raise UsageError(f"{spell('lora_targets')} {args.lora_targets!r} names no module; pass e.g. {example}")


def check_microbatches(args: argparse.Namespace, spell) -> None:
    """With --pp > 1 the batch must split into equal pipeline micro-batches."""
    if args.pp > 1 and args.batch_size % (args.microbatch_size or 1):
        raise UsageError(f"{spell('batch_size')} {args.batch_size} must be a multiple of {spell('microbatch_size')} "
                         f"{args.microbatch_size} (pipeline micro-batches are equal)")


def check_file(flag: str, value: str | None) -> None:
    if value is not None and not Path(value).expanduser().is_file():
        kind = "a folder, not a file" if Path(value).expanduser().is_dir() else "no such file"
        raise UsageError(f"{flag} {value}: {kind}")


def check_output_dir(flag: str, value: str) -> None:
    """The folder outputs go to: made here if missing (the run would make it anyway), and writable."""
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {value}: a file, not a folder; pass a folder for the outputs")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"{flag} {value}: cannot make this folder ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {value}: this process may not write in this folder")


def check_model_source(flag: str, value: str | None, needs: str | None = None) -> None:
    """An HF folder (holding the file `needs`, when given), or a name the Hub could serve ('gpt2',
    'org/name'); a path that is neither (a missing folder, a file) is refused naming the flag. Whether the
    Hub has the name is the loader's."""
    if value is None:
        return
    path = Path(value).expanduser()
    if path.is_dir():
        if needs and not (path / needs).is_file():
            raise UsageError(f"{flag} {value}: a folder without {needs}; pass an HF model folder "
                             "(save_pretrained's) or a hub id")
        return
    if path.exists():
        raise UsageError(f"{flag} {value}: a file; pass an HF folder (its config.json beside the weights) or a "
                         "hub id")
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(value)
    except HFValidationError:
        raise UsageError(f"{flag} {value}: no such folder (nor a hub id such as 'org/name')") from None


def load_failure(flag: str, value: str, error: Exception) -> UsageError:
    """The one line for a model source that exists (or names a hub id) but does not load."""
    words = " ".join(str(error).split())
    first = words if len(words) <= 240 else words[:240] + " ..."
    where = "folder" if Path(value).expanduser().is_dir() else "hub id (no such folder here)"
    return UsageError(f"{flag} {value}: this {where} does not load: {type(error).__name__}: {first}")
