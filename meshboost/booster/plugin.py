"""The Plugin interface the Booster dispatches to. A plugin owns how a model, optimizer and
dataloader are made parallel; the Booster owns none of it."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable, Iterator

import torch.nn as nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset


class Plugin(ABC):
    """Base class of every parallel strategy."""

    @abstractmethod
    def configure(self, model: nn.Module, optimizer: Optimizer | None = None, criterion: Callable | None = None,
                  dataloader: DataLoader | None = None, lr_scheduler=None) -> tuple:
        """Return boosted (model, optimizer, criterion, dataloader, lr_scheduler)."""

    @abstractmethod
    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           **kwargs) -> DataLoader:
        """A DataLoader that gives each data-parallel replica its own samples."""

    def backward(self, loss, optimizer) -> None:
        optimizer.backward(loss)

    def no_sync(self, model: nn.Module, optimizer=None) -> contextlib.AbstractContextManager:
        """Context in which gradients accumulate locally without data-parallel reduction."""
        return contextlib.nullcontext()

    def execute_pipeline(self, data_iter: Iterator, model, criterion, optimizer=None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict:
        raise NotImplementedError(f"{type(self).__name__} has no pipeline parallelism; use "
                                  "HybridParallelPlugin(pp_size>1)")

    @property
    def supports_pipeline(self) -> bool:
        return False
