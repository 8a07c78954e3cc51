"""The GRPO example end to end on a tiny random Llama, offline, on the CPU: RL alone teaches it a task.

A reward passed as `--reward file.py:function` (the first completion token must be id 7; chance 1/16) rises from
the first steps' mean to the last steps' (the test's margin: 0.4) at world 1 and with --tp 2 (from the same init and
seeds, the first step's rewards are one process's); a run stopped at step 4 (of 6) with --save-every 4 and
continued with --resume writes the uninterrupted run's records (the same rewards, the same losses); LoRA with the KL
to its base on the copy task runs and logs every metric; bad flags (--num-generations 1, --pp 2, a --reward that
does not import, every number flag's out-of-range values) are one line naming the flag, exit code 2; the tasks'
rewards score hand-written completions exactly and their prompts are a function of (seed, step)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.examples.torchrun import ROOT, failure, run_example

SCRIPT = ROOT / "examples" / "language" / "rl" / "grpo.py"
COMMON = ["--vocab", "16", "--max-new-tokens", "1", "--num-generations", "16", "--prompts-per-step", "4",
          "--lr", "1e-2", "--grpo-steps", "2", "--max-steps", "6", "--report-to", "jsonl"]
METRICS = ("loss", "reward_mean", "reward_std", "kl", "clip_fraction", "entropy", "response_length",
           "tokens_per_s", "grad_norm")
REWARD = "def first_is_seven(prompts, completions):\n    return [float(c[:1] == [7]) for c in completions]\n"


def _launch(out: Path, nproc, *args: str) -> subprocess.CompletedProcess:
    return run_example(SCRIPT, *args, "--output-dir", str(out), nproc=nproc, cwd=out.parent, timeout=300)


def _run(out: Path, nproc, *args: str, ending: str = "done at step 6 of 6") -> list[dict]:
    proc = _launch(out, nproc, *COMMON, *args)
    assert proc.returncode == 0, failure(proc)
    assert "layout: " in proc.stdout and ending in proc.stdout, proc.stdout[-2000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _rises(records: list[dict], what: str) -> None:
    assert [r["step"] for r in records] == list(range(1, 7)), what
    for r in records:
        assert all(isinstance(r[k], float) for k in METRICS), (what, r)
    rewards = [r["reward_mean"] for r in records]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.4, f"{what}: the mean reward went {rewards}"


def test_reward_rises_resumes_and_runs_at_tp2(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text(REWARD)
    custom = ["--reward", f"{reward}:first_is_seven", "--seed", "5"]
    want = _run(tmp_path / "one", None, *custom)
    _rises(want, "world 1")
    out = tmp_path / "resumed"
    first = _run(out, None, *custom, "--save-every", "4", "--stop-after", "4", ending="stopped at step 4 of 6")
    assert [r["step"] for r in first] == [1, 2, 3, 4] and (out / "checkpoints").is_dir(), first
    got = _run(out, None, *custom, "--resume")
    for g, w in zip(got, want, strict=True):
        assert g["reward_mean"] == w["reward_mean"] and g["response_length"] == w["response_length"], (g, w)
        for key in ("loss", "kl", "clip_fraction", "entropy", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=1e-5, abs=1e-7), (key, g, w)
    tp2 = _run(tmp_path / "tp2", 2, *custom, "--tp", "2")
    _rises(tp2, "tp=2")
    # the first rollouts come from the same init and seeds: the same samples as one process; later steps follow
    # Adam at lr 1e-2, which amplifies the tp round-off of near-zero gradients until a sample may differ
    assert tp2[0]["reward_mean"] == want[0]["reward_mean"], (tp2[0], want[0])
    assert tp2[0]["loss"] == pytest.approx(want[0]["loss"], rel=1e-3, abs=1e-5), (tp2[0], want[0])

def test_lora_with_kl_on_copy(tmp_path):
    records = _run(tmp_path / "lora", None, "--task", "copy", "--lora", "--beta", "0.05", "--max-steps", "2",
                   "--max-new-tokens", "3", "--num-generations", "4", "--prompts-per-step", "2",
                   ending="done at step 2 of 2")
    assert [r["step"] for r in records] == [1, 2]
    assert records[-1]["kl"] > 0 and records[-1]["response_length"] <= 3, records


@pytest.mark.parametrize("args, words", [
    (["--num-generations", "1"], "--num-generations=1 must be >= 2"),
    (["--pp", "2"], "--pp=2: rollouts run transformers' generate"),
    (["--reward", "no_such_module_here:f"], "--reward 'no_such_module_here:f': no_such_module_here does not import"),
])
def test_bad_flags_are_one_line(tmp_path, capsys, args, words):
    """In this process: the checks run before anything is launched."""
    sys.path.insert(0, str(SCRIPT.parent))
    import grpo
    assert grpo.main([*args, "--output-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert words in err and len([line for line in err.splitlines() if line.startswith("grpo.py:")]) == 1, err


def test_every_number_flag_has_a_rule_that_refuses(tmp_path, capsys):
    """As tests/examples/test_script_flags.py checks the other scripts: the table cannot silently miss a flag."""
    from tests.examples.test_script_flags import _bad_values, _refused
    sys.path.insert(0, str(SCRIPT.parent))
    import grpo
    numeric = {a.dest: a.type for a in grpo.build_parser()._actions if a.type in (int, float) and a.choices is None}
    assert set(numeric) - set(grpo.NUMBERS) == {"seed"} and set(grpo.NUMBERS) <= set(numeric)
    for dest, (ok, what) in grpo.NUMBERS.items():
        for value in [v for v in _bad_values(ok) if numeric[dest] is float or isinstance(v, int)]:
            line = _refused(grpo, [grpo.spell(dest), str(value)], tmp_path, capsys)
            assert line.startswith(f"grpo.py: {grpo.spell(dest)}=") and what in line, (dest, value, line)


def test_task_rewards_are_exact_matches():
    """The tasks' rewards on hand-written completions (token ids: 2 + d is digit d; 14 the copy separator)."""
    sys.path.insert(0, str(SCRIPT.parent))
    import rl_tasks as t
    assert t.target_token_reward([[5, 6]] * 3, [[2], [3, 2], []]) == [1.0, 0.0, 0.0]
    assert t.copy_reward([[4, 5, 6, 14]] * 3, [[4, 5, 6], [4, 9, 6, 7], [5, 6]]) == [1.0, 2 / 3, 0.0]
    # 7 + 8 = 15: digits 1, 5 -> tokens 3, 7; 2 + 3 = 5 -> token 7
    assert t.add_reward([[9, 12, 10, 13], [4, 12, 5, 13]], [[3, 7], [7, 3]]) == [1.0, 1.0]
    assert t.add_reward([[9, 12, 10, 13], [4, 12, 5, 13]], [[7], [6]]) == [0.0, 0.0]
    for task in t.TASKS:         # a function of (seed, step) only: a resumed run draws the same prompts
        a, b = (t.step_prompts(task, 3, 7, 4, 16) for _ in range(2))
        assert a == b != t.step_prompts(task, 3, 8, 4, 16)
        assert all(t.FIRST <= tok < 16 for p in a for tok in p), (task, a)
