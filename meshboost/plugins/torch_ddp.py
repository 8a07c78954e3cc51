"""TorchDDPPlugin: plain data parallelism with torch's DistributedDataParallel over all ranks."""

from __future__ import annotations

import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh, get_current_device
from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.quantized import is_nf4
from meshboost.plugins.config import DDP_BUCKET_CAP_MB, DDPConfig
from meshboost.plugins.ddp_hooks import fp8_refusal, register_counting_allreduce, register_fp8_allreduce


class TorchDDPModel(ModelWrapper):
    def no_sync(self):
        return self.module.no_sync()


class TorchDDPPlugin(Plugin):
    """Replicate the model on every rank and average gradients with torch DDP over a dp-only mesh.

    Arguments are passed to `torch.nn.parallel.DistributedDataParallel` (`DDPConfig`).
    fp8_communication=True: gradient buckets are all-reduced in fp8 with per-rank scales
    (`meshboost.distributed.fp8`, lossy by design) on CUDA; refused on the CPU (docs/colossalai.md).
    """

    def __init__(self, broadcast_buffers: bool = True, bucket_cap_mb: int = DDP_BUCKET_CAP_MB,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, fp8_communication: bool = False):
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings({k: v for k, v in locals().items() if k != "self"}, "TorchDDPPlugin arguments")
        refusal = fp8_refusal(get_current_device().type, "TorchDDPPlugin") if fp8_communication else None
        if refusal:                                                     # pure: the same on every rank
            raise NotImplementedError(refusal)
        self.fp8_communication = bool(fp8_communication)
        self.ddp_config = DDPConfig(broadcast_buffers, bucket_cap_mb, find_unused_parameters, check_reduction,
                                    gradient_as_bucket_view, static_graph)
        self.mesh = ParallelMesh()                  # collective: after the checks

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        device = self.mesh.device
        model = model.to(device)
        # the group the parameters' records say averages their gradients (the mesh answers: dp)
        group = self.mesh.reduction_of(p for p in model.parameters() if p.requires_grad)[1]
        # frozen NF4 bases (QLoRA) are built alike on every rank; DDP's broadcast would overwrite their 4-bit data
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [n for n, p in model.named_parameters() if is_nf4(p)])
        ddp = DistributedDataParallel(model, process_group=group,
                                      device_ids=[device] if device.type == "cuda" else None, **self.ddp_config.kwargs())
        if self.fp8_communication:
            register_fp8_allreduce(ddp, group)
        else:
            register_counting_allreduce(ddp, group)
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = OptimizerWrapper(optimizer)
        return TorchDDPModel(ddp), optimizer, criterion, dataloader, lr_scheduler

    def lora_refusal(self) -> None:
        return None                       # adapters are ordinary trainable parameters to DDP

    def no_sync(self, model, optimizer=None):
        if not isinstance(model, TorchDDPModel):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        return model.no_sync()
