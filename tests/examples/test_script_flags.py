"""Every flag of the two training scripts (examples/language/causal_lm/finetune.py, examples/language/bert/
finetune.py) refuses a bad value with one line naming the flag and exit code 2, before anything trains
(issue 56 item 6: `--max-steps -3` trained nothing and exited 0; `--model /nonexistent/folder` printed a
huggingface_hub "Repo id" traceback on every rank), and a flag typo prints argparse's usage once per
launch, not once per rank, and the README's main command installs tensorboard, which the records' default
needs (item 10).

- every int/float flag has a rule in its script's NUMBERS table (or is listed here as taking any value),
  and each rule refuses its out-of-range values: the table cannot silently miss a new flag;
- paths: a missing model folder, a file given as a model, a folder without config.json, a missing data
  file, an output folder that is a file; a hub id that is not cached (offline) names the flag too;
- malformed data (JSONL, CSV) names the file and line; --seq / --max_length beyond the model's positions;
- rank 1 prints nothing for any of these, rank 0 prints the one line; under torchrun a typo's usage
  appears once.
The checks run in-process (they return before the process group exists), so the whole module is cheap.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from pathlib import Path

import pytest

from tests.examples.torchrun import ROOT, run_example

CAUSAL = ROOT / "examples" / "language" / "causal_lm" / "finetune.py"
BERT = ROOT / "examples" / "language" / "bert" / "finetune.py"
ANY_VALUE = {"seed"}          # int flags every value of which is fine (launch takes seed % 2**32)


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scripts():
    try:
        return {"causal": _load(CAUSAL, "causal_lm_finetune"), "bert": _load(BERT, "bert_finetune")}
    except ImportError as e:      # the examples' extras (datasets, sklearn) are optional
        pytest.skip(f"example requirements not installed: {e}")


def _spell(which: str, dest: str) -> str:
    return "--" + (dest.replace("_", "-") if which == "causal" else dest)


def _refused(script, argv, tmp_path, capsys, rank: str = "0") -> str:
    """Run the script's main in this process at RANK `rank`: exit code 2 and the one stderr line (rank 0)."""
    out = "--output-dir" if "causal" in script.__name__ else "--output_dir"
    if out not in argv:
        argv = [*argv, out, str(tmp_path / "out")]
    old = os.environ.get("RANK")
    os.environ["RANK"] = rank
    try:
        rc = script.main(argv)
    except SystemExit as e:            # argparse
        rc = e.code
    finally:
        os.environ.pop("RANK") if old is None else os.environ.update(RANK=old)
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip() and not line.startswith("Failed to load")]
    assert rc == 2, (argv, rc, captured.err[-2000:])
    assert "Traceback" not in captured.err, captured.err[-2000:]
    if rank != "0":
        assert lines == [] and captured.out == "", (argv, captured)
        return ""
    assert len(lines) == 1, (argv, lines)
    return lines[0]


def _bad_values(ok) -> list:
    """Values a rule should refuse among the usual suspects (every rule refuses NaN and inf)."""
    bad = [v for v in (-5, -1, 0, 1.5, 2) if not ok(v)]
    assert bad, "a rule that refuses none of -5, -1, 0, 1.5, 2"
    return bad + [math.nan, math.inf]


@pytest.mark.parametrize("which", ["causal", "bert"])
def test_every_number_flag_has_a_rule(which, scripts):
    script = scripts[which]
    numeric = {a.dest for a in script.build_parser()._actions if a.type in (int, float) and a.choices is None}
    assert numeric - set(script.NUMBERS) - ANY_VALUE == set(), "number flags without a rule"
    assert set(script.NUMBERS) <= numeric, "rules for flags that do not exist"


@pytest.mark.parametrize("which", ["causal", "bert"])
def test_every_rule_refuses_its_bad_values_in_one_line(which, scripts, tmp_path, capsys):
    script = scripts[which]
    for dest, (ok, what) in script.NUMBERS.items():
        kind = next(a.type for a in script.build_parser()._actions if a.dest == dest)
        # argparse itself refuses "nan" or "1.5" for an int flag
        for value in [v for v in _bad_values(ok) if kind is float or isinstance(v, int)]:
            flag = _spell(which, dest)
            line = _refused(script, [flag, str(value)], tmp_path, capsys)
            assert line.startswith(f"finetune.py: {flag}=") and what in line, (flag, value, line)


CASES = {
    "causal": [
        (["--max-steps", "-3"], "--max-steps=-3 must be >= 1"),
        (["--model", "/nonexistent/folder"], "--model /nonexistent/folder: no such folder"),
        (["--model", "{tmp}"], "a folder without config.json"),
        (["--model", "{file}"], "--model {file}: a file"),
        (["--model", "not-cached-model-xyz"], "--model not-cached-model-xyz: this hub id (no such folder here) does not load"),
        (["--tokenizer", "./missing"], "--tokenizer ./missing: no such folder"),
        (["--data", "{tmp}"], "--data {tmp}: a folder, not a file"),
        (["--data", "{bad_jsonl}"], "line 2: not a JSON object"),
        (["--output-dir", "{file}"], "--output-dir {file}: a file, not a folder"),
        (["--lora", "--lora-targets", ","], "--lora-targets ',' names no module"),
        (["--model", "{bert_model}", "--seq", "1024"], "--seq=1024 is longer than the 512 positions"),
    ],
    "bert": [
        (["--max_steps", "-3"], "--max_steps=-3 must be >= 1"),
        (["--model", "/nonexistent/folder"], "--model /nonexistent/folder: no such folder"),
        (["--model", "{tmp}"], "a folder without config.json"),
        (["--train_file", "/missing.csv"], "--train_file /missing.csv: no such file"),
        (["--train_file", "{bad_csv}"], "cannot be read as CSV"),
        (["--output_dir", "{file}"], "--output_dir {file}: a file, not a folder"),
        (["--plugin", "low_level_zero", "--zero", "3"], "--zero 3: --plugin low_level_zero runs ZeRO stage 1 or 2"),
        (["--lora", "--lora_targets", ""], "--lora_targets '' names no module"),
        (["--max_length", "1000"], "--max_length=1000 is longer than the 512 positions"),
    ],
}


@pytest.mark.parametrize("which", ["causal", "bert"])
def test_bad_paths_and_data_refused_in_one_line(which, scripts, tmp_path, capsys):
    script = scripts[which]
    files = {"tmp": str(tmp_path), "file": str(tmp_path / "a_file"), "bad_jsonl": str(tmp_path / "bad.jsonl"),
             "bad_csv": str(tmp_path / "bad.csv")}
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{not json\n')
    (tmp_path / "bad.csv").write_text('text,label\n"an open quote,1\n')
    for argv, expected in CASES[which]:
        if "{bert_model}" in argv:
            try:
                files["bert_model"] = scripts["causal"].data.default_tokenizer_path()
            except scripts["causal"].data.DataError as e:
                pytest.skip(f"example data not installed: {e}")
        argv = [a.format(**files) for a in argv]
        line = _refused(script, argv, tmp_path, capsys)
        assert expected.format(**files) in line, (argv, line)
        _refused(script, argv, tmp_path, capsys, rank="1")      # the other ranks exit 2 silently


def test_main_command_installs_what_the_records_need():
    """The README's main command installs the examples' requirements, and they hold tensorboard: the default
    --report-to all promises TensorBoard event files (item 10: they were only written where it happened to be
    installed)."""
    readme = (ROOT / "README.md").read_text()
    command = readme[readme.index("<!-- main-command:start -->"):readme.index("<!-- main-command:end -->")]
    assert "-r requirements/requirements-examples.txt" in command, command
    names = {re.split(r"[<>=!~\[ ;#]", line.strip(), maxsplit=1)[0].lower()
             for line in (ROOT / "requirements" / "requirements-examples.txt").read_text().splitlines()
             if line.strip() and not line.startswith(("#", "-"))}
    assert {"tensorboard", "tqdm", "peft", "datasets"} <= names, sorted(names)


def test_typo_prints_usage_once_under_torchrun(tmp_path):
    proc = run_example(CAUSAL, "--max-stepz", "3", "--output-dir", str(tmp_path), nproc=2, cwd=tmp_path, timeout=240)
    assert proc.returncode != 0
    assert proc.stderr.count("usage: finetune.py") == 1, proc.stderr[-3000:]
    assert proc.stderr.count("unrecognized arguments: --max-stepz 3") == 1, proc.stderr[-3000:]
