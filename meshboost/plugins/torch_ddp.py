"""TorchDDPPlugin: plain data parallelism with torch's DistributedDataParallel over all ranks."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from meshboost.booster.plugin import Plugin
from meshboost.booster.wrappers import ModelWrapper, OptimizerWrapper
from meshboost.launch import get_current_device
from meshboost.plugins.dataloader import build_dataloader
from meshboost.plugins.ddp_hooks import register_counting_allreduce


class TorchDDPModel(ModelWrapper):
    def no_sync(self):
        return self.module.no_sync()


class TorchDDPPlugin(Plugin):
    """Replicate the model on every rank and average gradients with torch DDP.

    Arguments are passed to `torch.nn.parallel.DistributedDataParallel`.
    """

    def __init__(self, broadcast_buffers: bool = True, bucket_cap_mb: int = 25, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("TorchDDPPlugin needs an initialised process group: call meshboost.launch_from_torch()")
        self.ddp_kwargs = dict(broadcast_buffers=broadcast_buffers, bucket_cap_mb=bucket_cap_mb,
                               find_unused_parameters=find_unused_parameters, check_reduction=check_reduction,
                               gradient_as_bucket_view=gradient_as_bucket_view, static_graph=static_graph)

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        device = get_current_device()
        model = model.to(device)
        ddp = DDP(model, device_ids=[device] if device.type == "cuda" else None, **self.ddp_kwargs)
        register_counting_allreduce(ddp, None)
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        return TorchDDPModel(ddp), optimizer, criterion, dataloader, lr_scheduler

    def prepare_dataloader(self, dataset, batch_size, shuffle=False, seed=1024, drop_last=False, pin_memory=False,
                           num_workers=0, **kwargs):
        return build_dataloader(dataset, batch_size, dist.get_world_size(), dist.get_rank(), shuffle, seed,
                                drop_last, pin_memory, num_workers, **kwargs)

    def no_sync(self, model, optimizer=None):
        if not isinstance(model, TorchDDPModel):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        return model.no_sync()
