"""The model a plan is made for: its transformers config and a meta-device instance of it.

Owns: reading the model argument (an HF model folder, a `config.json` path, or a model type with
overrides: `AutoConfig.for_model(type, **overrides)`), choosing the class to build (the config's
own `architectures[0]`, else a causal LM, else the base model) and building it on the meta device,
where nothing is allocated or downloaded. Must not shard or cut the model (params.py does, on
copies).
"""

from __future__ import annotations

import ast
import json
import os

import torch
import torch.nn as nn


def parse_overrides(text: str | None) -> dict:
    """'hidden_size=4096,num_hidden_layers=32,tie_word_embeddings=false' -> a dict of Python values
    (ints, floats, booleans, None, or strings)."""
    out: dict = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        out[key.strip()] = _value(value.strip())
    return out


def _value(text: str):
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def load_config(model: str, overrides: dict | None = None):
    """The transformers config for `model`: a folder holding config.json, a config.json file, or a
    model type (`llama`, `gpt2`, ...) built with `AutoConfig.for_model`. Never downloads."""
    from transformers import AutoConfig, PretrainedConfig

    overrides = dict(overrides or {})
    if isinstance(model, PretrainedConfig):
        config = model
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f)
        model_type = raw.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{path} has no model_type; cannot tell which transformers config to build")
        raw.update(overrides)
        return AutoConfig.for_model(model_type, **raw)
    return AutoConfig.for_model(model, **overrides)


def model_class(config, architecture: str | None = None):
    """The transformers class to build: `architecture`, the config's `architectures[0]`, else the
    causal-LM class of its type, else its base model."""
    import transformers
    from transformers import AutoModel, AutoModelForCausalLM

    names = [architecture] if architecture else list(getattr(config, "architectures", None) or [])
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
        if architecture:
            raise ValueError(f"--architecture {architecture!r} is not a transformers class")
    for auto in (AutoModelForCausalLM, AutoModel):
        mapping = auto._model_mapping
        if type(config) in mapping:
            return mapping[type(config)]
    raise ValueError(f"no transformers model class for {type(config).__name__}; pass architecture=...")


def build_meta_model(config, architecture: str | None = None) -> nn.Module:
    """The model of `config` on the meta device (no memory, no weights), in training mode."""
    cls = model_class(config, architecture)
    with torch.device("meta"):
        model = cls(config)
    return model.train()
