"""Preference pairs for the preference example: read from JSONL or built offline from the BBC News corpus,
tokenised into fixed-length rows (prompt tokens masked).

Owns: `read_pairs` (JSONL rows {"prompt", "chosen", "rejected"}; a prompt may be a string or chat messages,
which go through the tokenizer's chat template with the generation prompt), `bbc_pairs` (offline pairs: the
prompt is the end of an article's first sentence, chosen its real next sentence, rejected the next article's
second sentence: a continuation that does not follow), `pair_rows` (one row per pair:
chosen_* and rejected_* tensors of --seq tokens, labels -100 on the prompt and padding, plus kl_* rows, the
prompt with the next pair's chosen response, for KTO's KL estimate). Documents and the tokenizer come from
examples/language/causal_lm/lm_data.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from lm_data import DataError, read_documents

IGNORE = -100
_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def read_pairs(path: str) -> list[dict]:
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--data {path}: no such file")
    pairs = []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = [k for k in ("prompt", "chosen", "rejected") if k not in row]
        if missing:
            raise DataError(f"--data {path} line {n}: a preference row needs \"prompt\", \"chosen\" and \"rejected\"; "
                            f"{missing} missing (got {sorted(row)})")
        pairs.append({k: row[k] for k in ("prompt", "chosen", "rejected")})
    return pairs


def bbc_pairs(prompt_words: int = 16) -> list[dict]:
    """Pairs from the 2,225 BBC articles: prompt = the last `prompt_words` words of article i's first sentence
    (its title and lead), chosen = its second sentence, rejected = the second sentence of article i + 1 (cyclic)."""
    articles = [_SENTENCE.split(doc) for doc in read_documents(None)]
    articles = [a for a in articles if len(a) > 1]
    return [{"prompt": " ".join(a[0].split()[-prompt_words:]), "chosen": a[1],
             "rejected": articles[(i + 1) % len(articles)][1]} for i, a in enumerate(articles)]


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, list):          # chat messages: the template, ending where the assistant's turn starts
        return list(tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                  return_dict=True)["input_ids"])
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def _row(prompt: list[int], response: list[int], seq: int, pad: int) -> dict:
    ids = (prompt + response)[:seq]             # a long response is cut to the limit (the prompt fits: checked)
    labels = [IGNORE] * len(prompt) + (prompt + response)[len(prompt):seq]
    n = len(ids)
    return {"input_ids": torch.tensor(ids + [pad] * (seq - n)), "attention_mask": torch.tensor([1] * n + [0] * (seq - n)),
            "labels": torch.tensor(labels + [IGNORE] * (seq - n))}


def pair_rows(pairs: list[dict], tokenizer, seq: int) -> list[dict]:
    """One row per pair (chosen_*, rejected_*, kl_* fields, each [seq]). A prompt that leaves no room for a
    response token within --seq is refused, naming the pair (every rank reads the same data: the same error)."""
    encoded = []
    for n, pair in enumerate(pairs):
        prompt = _prompt_ids(pair["prompt"], tokenizer)
        if len(prompt) >= seq:
            raise DataError(f"pair {n}: its prompt holds {len(prompt)} tokens, the sequence limit --seq {seq} leaves no "
                            "room for a response token; raise --seq or drop the pair")
        sides = [tokenizer(" " + pair[k], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                 for k in ("chosen", "rejected")]
        encoded.append((prompt, *sides))
    rows = []
    for n, (prompt, chosen, rejected) in enumerate(encoded):
        row = {}
        mismatched = encoded[(n + 1) % len(encoded)][1]
        for side, response in (("chosen", chosen), ("rejected", rejected), ("kl", mismatched)):
            row |= {f"{side}_{k}": v for k, v in _row(prompt, response, seq, tokenizer.pad_token_id).items()}
        rows.append(row)
    if not rows:
        raise DataError("no preference pair to train on")
    return rows
