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

    def save_model(self, model: nn.Module, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                   prefix: str | None = None, size_per_shard: int = 1024, use_safetensors: bool = False) -> None:
        """HF-format save of a model whose parameters are full on every rank (DDP, ZeRO): rank 0 writes.
        Plugins that shard parameters override this to pass their mesh."""
        from meshboost.checkpoint import save_model
        save_model(model, checkpoint, None, shard, gather_dtensor, prefix, size_per_shard, use_safetensors)

    # -- checkpoints other than save_model (meshboost/checkpoint/booster_io.py; any plugin's mesh) --
    def load_model(self, model: nn.Module, checkpoint: str, strict: bool = True) -> None:
        from meshboost.checkpoint.booster_io import load_boosted_model
        load_boosted_model(model, checkpoint, strict, getattr(self, "mesh", None))

    def save_optimizer(self, optimizer, checkpoint: str, shard: bool = False, gather_dtensor: bool = True,
                       prefix: str | None = None, size_per_shard: int = 1024) -> None:
        from meshboost.checkpoint.booster_io import save_boosted_optimizer
        save_boosted_optimizer(optimizer, checkpoint, shard, gather_dtensor, prefix, size_per_shard,
                               getattr(self, "mesh", None))

    def load_optimizer(self, optimizer, checkpoint: str) -> None:
        from meshboost.checkpoint.booster_io import load_boosted_optimizer
        load_boosted_optimizer(optimizer, checkpoint)

    def save_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        from meshboost.checkpoint.booster_io import save_lr_scheduler
        save_lr_scheduler(lr_scheduler, checkpoint, getattr(self, "mesh", None))

    def load_lr_scheduler(self, lr_scheduler, checkpoint: str) -> None:
        from meshboost.checkpoint.booster_io import load_lr_scheduler
        load_lr_scheduler(lr_scheduler, checkpoint)
