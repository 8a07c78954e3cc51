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
    model type (`llama`, `gpt2`, ...) built with `AutoConfig.for_model`. Never downloads. A path that
    does not exist, a model type transformers does not know, corrupt JSON and a field of the wrong type
    raise a one-line ValueError naming the value and the fix."""
    from transformers import PretrainedConfig

    overrides = dict(overrides or {})
    if isinstance(model, PretrainedConfig):
        config = model
        for key, value in overrides.items():
            setattr(config, key, value)
        return config
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if os.path.isfile(path):
        raw = _read_json(path)
        model_type = raw.pop("model_type", None)
        if model_type is None:
            raise ValueError(f"{path} has no model_type; cannot tell which transformers config to build "
                             "(add \"model_type\": \"llama\" or the like to it)")
        raw.update(overrides)
        return _for_model(_known_type(model_type, f"{path}'s model_type"), raw, path)
    if os.sep in model or model.endswith(".json") or os.path.isdir(model):
        where = f"{model} holds no config.json" if os.path.isdir(model) else f"no such file: {model}"
        raise ValueError(f"--model {model}: {where}; pass an HF model folder, its config.json, or a model type "
                         "(llama, gpt2, ...)")
    return _for_model(_known_type(model, f"--model {model}"), overrides, "--set")


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                         "fix the file (or pass a model type with --set overrides)") from None
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object of config fields")
    return raw


def _known_type(model_type, what: str) -> str:
    """`model_type` if transformers knows it, else a ValueError with the closest names (not the list)."""
    import difflib

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(model_type, str) and model_type in CONFIG_MAPPING:
        return model_type
    close = difflib.get_close_matches(str(model_type), list(CONFIG_MAPPING.keys()), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}?" if close else "see transformers' CONFIG_MAPPING for the model types"
    raise ValueError(f"{what}: {model_type!r} is not a model type transformers knows; {hint}")


def _for_model(model_type: str, fields: dict, source: str):
    """`AutoConfig.for_model`, its field errors (a str where an int belongs, ...) on one line."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, StrictDataclassError) as exc:
        detail = " ".join(str(exc).split())
        raise ValueError(f"{model_type} config from {source} refused by transformers: {detail}; "
                         "fix that field's value") from None


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
