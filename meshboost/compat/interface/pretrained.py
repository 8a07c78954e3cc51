"""ColossalAI's `interface.pretrained`: the path a model was loaded from, recorded on the model.

ColossalAI's scripts and plugins set it (`set_pretrained_path(model, path)`) so that a later step can
reload the weights; it is ColossalAI's convention, the `_pretrained` attribute of the module, kept so
that scripts reading either one agree. meshboost itself never reads it: `from_pretrained` inside
`LazyInitContext` loads the checkpoint for real. Boosted models are looked through (`unwrap()`).
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.booster import ModelWrapper

__all__ = ["get_pretrained_path", "set_pretrained_path"]

ATTRIBUTE = "_pretrained"       # ColossalAI's name for it


def _user_model(model: nn.Module) -> nn.Module:
    return model.unwrap() if isinstance(model, ModelWrapper) else model


def get_pretrained_path(model: nn.Module) -> str | None:
    """The path recorded by `set_pretrained_path` on `model` (or the model a boosted one wraps), else None."""
    return getattr(_user_model(model), ATTRIBUTE, None)


def set_pretrained_path(model: nn.Module, path: str) -> None:
    """Record `path` as where `model` (or the model a boosted one wraps) was loaded from."""
    setattr(_user_model(model), ATTRIBUTE, path)
