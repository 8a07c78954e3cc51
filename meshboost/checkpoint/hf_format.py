"""The HuggingFace checkpoint layout on disk: file names, the weights file writer and the index.

Owns: the names HF gives weight files (single, k-of-N shards, optional prefix), writing one
weights file (safetensors or torch pickle) and the `*.index.json` with its `weight_map`. Must not
gather tensors, communicate, or decide who writes what (that is `writer.py`).
"""

from __future__ import annotations

import json
import os

import torch

SAFE_WEIGHTS_NAME, SAFE_INDEX_NAME = "model.safetensors", "model.safetensors.index.json"
BIN_WEIGHTS_NAME, BIN_INDEX_NAME = "pytorch_model.bin", "pytorch_model.bin.index.json"
SINGLE_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def index_name(use_safetensors: bool) -> str:
    return SAFE_INDEX_NAME if use_safetensors else BIN_INDEX_NAME


def weights_name(use_safetensors: bool) -> str:
    return SAFE_WEIGHTS_NAME if use_safetensors else BIN_WEIGHTS_NAME


def shard_name(use_safetensors: bool, prefix: str | None, k: int, total: int) -> str:
    """model-0000k-of-0000N.safetensors / pytorch_model-0000k-of-0000N.bin, optionally `prefix-`ed."""
    stem, ext = weights_name(use_safetensors).rsplit(".", 1)
    return f"{prefix + '-' if prefix else ''}{stem}-{k:05d}-of-{total:05d}.{ext}"


def write_weights(tensors: dict[str, torch.Tensor], path: str, use_safetensors: bool) -> None:
    """Write one weights file (tensors must be full, contiguous and on the CPU)."""
    if use_safetensors:
        from safetensors.torch import save_file
        save_file(tensors, path, metadata={"format": "pt"})
    else:
        torch.save(tensors, path)


def read_weights(path: str, use_safetensors: bool) -> dict[str, torch.Tensor]:
    """Read one weights file written by `write_weights` (on the CPU)."""
    if use_safetensors:
        from safetensors.torch import load_file
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def write_index(folder: str, weight_map: dict[str, str], total_size: int, use_safetensors: bool) -> str:
    """Write the HF index (`metadata.total_size` and `weight_map`: tensor name -> file)."""
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    path = os.path.join(folder, index_name(use_safetensors))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path
