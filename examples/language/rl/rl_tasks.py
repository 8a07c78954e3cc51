"""Verifiable-reward tasks for the GRPO example, generated from a seed (no download), and the reward a user passes.

Owns: the tasks (`TASKS`: prompts drawn from a numpy generator, an exact-match reward per completion), the token ids
they reserve (0 padding, 1 end of sequence, the task's tokens from 2 on) and `load_reward` (`--reward
module:function` or `path/to/file.py:function`: any Python callable `reward(prompts, completions) -> floats`, one
per completion). Prompts and completions are lists of token ids; a reward for text decodes them with its own
tokenizer. Pure: no torch collective, no model.

- target-token: a random prompt; reward 1 when the completion's first token is the target id (`TARGET`), else 0.
- copy: a random string of `COPY_LENGTH` tokens then the separator; reward the fraction of its positions the
  completion repeats (position by position).
- add: "a + b =" with digits 0-9 as tokens; reward 1 when the completion starts with the sum's digits.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import numpy as np

PAD, EOS = 0, 1
FIRST = 2                     # the first token id a task uses
TARGET = FIRST                # target-token's reward token
COPY_LENGTH = 3
DIGITS = FIRST                # add: digit d is token DIGITS + d; then '+', '=', the copy separator
PLUS, EQUALS, SEPARATOR = FIRST + 10, FIRST + 11, FIRST + 12
MIN_VOCAB = FIRST + 13        # every task's tokens fit


def target_token_prompts(rng: np.random.Generator, n: int, vocab: int) -> list[list[int]]:
    return [rng.integers(FIRST, vocab, size=int(rng.integers(2, 5))).tolist() for _ in range(n)]


def target_token_reward(prompts, completions) -> list[float]:
    return [float(len(c) > 0 and c[0] == TARGET) for c in completions]


def copy_prompts(rng: np.random.Generator, n: int, vocab: int) -> list[list[int]]:
    # the string's tokens avoid the separator, so the prompt's end is unambiguous
    return [rng.integers(FIRST, SEPARATOR, size=COPY_LENGTH).tolist() + [SEPARATOR] for _ in range(n)]


def copy_reward(prompts, completions) -> list[float]:
    out = []
    for p, c in zip(prompts, completions):
        text = p[:p.index(SEPARATOR)] if SEPARATOR in p else p
        out.append(sum(a == b for a, b in zip(text, c)) / len(text))
    return out


def add_prompts(rng: np.random.Generator, n: int, vocab: int) -> list[list[int]]:
    pairs = rng.integers(0, 10, size=(n, 2))
    return [[DIGITS + int(a), PLUS, DIGITS + int(b), EQUALS] for a, b in pairs]


def add_reward(prompts, completions) -> list[float]:
    out = []
    for p, c in zip(prompts, completions):
        digits = [DIGITS + int(d) for d in str((p[0] - DIGITS) + (p[2] - DIGITS))]
        out.append(float(list(c[:len(digits)]) == digits))
    return out


TASKS = {"target-token": (target_token_prompts, target_token_reward),
         "copy": (copy_prompts, copy_reward),
         "add": (add_prompts, add_reward)}


def step_prompts(task: str, seed: int, step: int, n: int, vocab: int) -> list[list[int]]:
    """The global batch of prompts of rollout step `step`: a function of (seed, step) only, so a resumed run
    draws the prompts an uninterrupted one would, at any layout."""
    return TASKS[task][0](np.random.default_rng([seed, step]), n, vocab)


def load_reward(spec: str):
    """The callable `module:function` (an importable module, or a .py file's path) names; ValueError says why not."""
    module_name, _, function = spec.rpartition(":")
    if not module_name or not function:
        raise ValueError(f"--reward {spec!r}: give it as module:function or path/to/file.py:function")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name).expanduser()
            spec_ = importlib.util.spec_from_file_location(path.stem, path)
            if spec_ is None or not path.is_file():
                raise ImportError(f"no such file {path}")
            module = importlib.util.module_from_spec(spec_)
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--reward {spec!r}: {module_name} does not import ({e})") from None
    reward = getattr(module, function, None)
    if not callable(reward):
        raise ValueError(f"--reward {spec!r}: {module_name} has no callable {function!r}")
    return reward
