"""Thin wrappers a plugin returns from `boost`: they mark what was boosted and give one place for
plugins to hook backward and step. They hold no parallel logic of their own."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.optim import Optimizer


class ModelWrapper(nn.Module):
    """A boosted model: `forward` delegates; `unwrap()` returns the user's (sharded) model."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def unwrap(self) -> nn.Module:
        inner = self.module
        # DistributedDataParallel keeps the model under `.module` too.
        while isinstance(inner, (ModelWrapper, torch.nn.parallel.DistributedDataParallel)):
            inner = inner.module
        return inner


class OptimizerWrapper:
    """A boosted optimizer. Plain pass-through here; precision and ZeRO wrappers override
    `backward`, `step` and the gradient-norm hooks."""

    def __init__(self, optim: Optimizer):
        self.optim = optim

    # -- the torch.optim.Optimizer surface ------------------------------------------------------
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def defaults(self):
        return self.optim.defaults

    @property
    def state(self):
        return self.optim.state

    def add_param_group(self, *args, **kwargs):
        return self.optim.add_param_group(*args, **kwargs)

    def step(self, *args, **kwargs):
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    # -- booster hooks -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args, **kwargs):
        loss.backward(*args, **kwargs)

    def unwrap(self) -> Optimizer:
        return self.optim

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"
