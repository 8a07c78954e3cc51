"""The Plugin interface the Booster dispatches to. A plugin owns how a model, optimizer and
dataloader are made parallel and declares the mesh it does it over; the Booster owns none of it.
(ColossalAI's paths for it, `booster.plugin.Plugin` and `booster.plugin.plugin_base.Plugin`, are served
by `meshboost.compat`.)"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Callable, Iterator

import torch.distributed as dist
import torch.nn as nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader, Dataset

from meshboost.booster.dataloader import build_dataloader
from meshboost.distributed import ParallelMesh


class Plugin(ABC):
    """Base class of every parallel strategy. Subclasses set `self.mesh` (built after their own
    argument checks, so a bad argument raises on every rank before any collective)."""

    mesh: ParallelMesh
    precision: str | None = None      # a plugin that keeps fp32 masters itself names its working precision

    def __init__(self) -> None:
        """ColossalAI's `DPPluginBase.__init__` (DPPluginBase is this class): a subclass that builds no
        mesh of its own (one that only implements `configure`) gets a dp-only mesh over every rank, so
        `prepare_dataloader` gives each rank its own samples; `rank` and `world_size` as ColossalAI's.
        A collective: every rank builds the plugin. meshboost's plugins build their own mesh instead."""
        if not dist.is_initialized():
            raise RuntimeError(f"{type(self).__name__}: torch.distributed is not initialised; call "
                               "meshboost.launch_from_torch() (or meshboost.launch) before building the plugin")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.mesh = ParallelMesh()

    @abstractmethod
    def configure(self, model: nn.Module, optimizer: Optimizer | None = None, criterion: Callable | None = None,
                  dataloader: DataLoader | None = None, lr_scheduler=None) -> tuple:
        """Return boosted (model, optimizer, criterion, dataloader, lr_scheduler)."""

    @property
    def dp_size(self) -> int:
        return self._own_mesh("dp_size").dp_size

    def prepare_dataloader(self, dataset: Dataset, batch_size: int, shuffle: bool = False, seed: int = 1024,
                           drop_last: bool = False, pin_memory: bool = False, num_workers: int = 0,
                           distributed_sampler_cls=None, **kwargs) -> DataLoader:
        """A DataLoader that gives each data-parallel replica its own samples (tensor- and
        pipeline-parallel ranks of one replica get the same ones).

        `distributed_sampler_cls` (ColossalAI's argument): a sampler class built as ColossalAI builds it,
        `cls(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle)` (its own default seed, as there),
        so a class of the script's own (ColossalChat's `StatefulDistributedSampler`) keeps its methods; the
        loader is then a plain DataLoader and that sampler owns resumption. Without it, meshboost's resumable
        loader (`booster.save_checkpoint(..., dataloader=loader)`; `loader.sampler.set_start_index`)."""
        mesh = self._own_mesh("prepare_dataloader")
        return build_dataloader(dataset, batch_size, mesh.dp_size, mesh.dp_rank, shuffle, seed, drop_last,
                                pin_memory, num_workers, sampler_cls=distributed_sampler_cls, **kwargs)

    def _own_mesh(self, what: str) -> ParallelMesh:
        """The plugin's mesh, or an error naming the fix for a subclass that built none."""
        mesh = getattr(self, "mesh", None)
        if mesh is None:
            raise AttributeError(f"{type(self).__name__}.{what}: the plugin has no mesh. A DPPluginBase (Plugin) "
                                 "subclass with an __init__ of its own must call super().__init__() (it builds "
                                 "the data-parallel mesh) or set self.mesh = ParallelMesh(...)")
        return mesh

    def backward(self, loss, optimizer) -> None:
        optimizer.backward(loss)

    def no_sync(self, model: nn.Module, optimizer=None) -> contextlib.AbstractContextManager:
        """Context in which gradients accumulate locally without data-parallel reduction."""
        return contextlib.nullcontext()

    def execute_pipeline(self, data_iter: Iterator, model, criterion, optimizer=None, return_loss: bool = True,
                         return_outputs: bool = False) -> dict:
        raise TypeError(f"{type(self).__name__} has no pipeline parallelism; use HybridParallelPlugin(pp_size>1)")

    @property
    def supports_pipeline(self) -> bool:
        return False

    def lora_refusal(self) -> str | None:
        """Why `booster.enable_lora` cannot train adapters with this plugin (None: it can). Pure."""
        return (f"{type(self).__name__} does not support LoRA (nor does ColossalAI's); use TorchDDPPlugin, "
                "LowLevelZeroPlugin or HybridParallelPlugin(tp_size=1, pp_size=1)")
