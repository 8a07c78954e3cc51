"""Booster: the user-facing dispatcher. Owns nothing parallel itself: every call goes to the
plugin, whose names and signatures follow ColossalAI's Booster so scripts port by changing
imports."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn as nn
from torch.optim import Optimizer

from meshboost.booster.plugin import Plugin
from meshboost.booster.wrappers import ModelWrapper, OptimizerWrapper


class Booster:
    """Boost a model, optimizer, criterion, dataloader and scheduler with a parallel `plugin`.

    >>> booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    >>> model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(model, optimizer, criterion)
    """

    def __init__(self, plugin: Plugin | None = None, mixed_precision: str | None = None):
        if plugin is not None and not isinstance(plugin, Plugin):
            raise TypeError(f"plugin must be a meshboost Plugin, got {type(plugin).__name__}")
        if mixed_precision is not None:
            raise NotImplementedError(
                f"Booster(mixed_precision={mixed_precision!r}) is not supported; choose precision on the plugin, "
                "e.g. HybridParallelPlugin(tp_size=1, precision='fp16') or TorchDDPPlugin")
        self.plugin = plugin

    def boost(self, model: nn.Module, optimizer: Optimizer | None = None, criterion: Callable | None = None,
              dataloader=None, lr_scheduler=None) -> tuple:
        """Return (model, optimizer, criterion, dataloader, lr_scheduler), made parallel by the plugin."""
        if self.plugin is None:
            return (ModelWrapper(model), OptimizerWrapper(optimizer) if optimizer is not None else None,
                    criterion, dataloader, lr_scheduler)
        return self.plugin.configure(model, optimizer, criterion, dataloader, lr_scheduler)

    def backward(self, loss: torch.Tensor, optimizer) -> None:
        """Backward through the boosted optimizer (which scales the loss under fp16)."""
        if not isinstance(optimizer, OptimizerWrapper):
            raise TypeError("booster.backward needs the optimizer returned by booster.boost(...)")
        if self.plugin is None:
            optimizer.backward(loss)
        else:
            self.plugin.backward(loss, optimizer)

    def no_sync(self, model: nn.Module | None = None, optimizer=None) -> contextlib.AbstractContextManager:
        """Accumulate gradients without data-parallel reduction inside the block."""
        if self.plugin is None:
            return contextlib.nullcontext()
        return self.plugin.no_sync(model, optimizer)

    def execute_pipeline(self, data_iter: Iterator, model, criterion, optimizer=None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict:
        """Run one pipeline-parallel step over the micro-batches of `data_iter` (pp_size > 1)."""
        if self.plugin is None:
            raise RuntimeError("execute_pipeline needs a plugin with pipeline parallelism")
        return self.plugin.execute_pipeline(data_iter, model, criterion, optimizer, return_loss, return_outputs)
