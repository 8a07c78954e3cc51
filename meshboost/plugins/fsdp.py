"""FSDPPlugin: ZeRO-3 data parallelism on torch FSDP2 (`fully_shard`), from one typed `FSDPConfig`
(ColossalAI's GeminiPlugin and TorchFSDPPlugin are compat's subclasses, their keywords mapped onto it).

Owns: the wiring only. Weights, gradients and optimizer states are sharded over every rank (a
dp-only mesh) by the FSDP2 engine (meshboost.fsdp), one unit per transformer layer
(`fsdp_wrap.transformer_layers`) plus the root; mixed precision is FSDP2's MixedPrecisionPolicy (fp32
sharded weights are the masters), CPU offload its CPUOffloadPolicy; the step (fp16 loss scale,
clipping by the global norm over the shards) is `FSDPOptimizer`'s. ColossalAI's keyword arguments map
onto the engine's `FSDPConfig` in compat (`booster/plugin/fsdp_keywords.py`, the table in docs/fsdp.md). Must not implement
sharding, reduction or checkpoint formats: meshboost.fsdp, meshboost.optim and meshboost.checkpoint do.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh
from meshboost.distributed.agreement import agree_settings
from meshboost.fsdp import (FSDPConfig, FSDPOptimizer, apply_fsdp, boost_optimizer, is_sharded, no_gradient_sync,
                            prepare, reshard_all)
from meshboost.optim import PrecisionConfig
from meshboost.plugins.fsdp_wrap import transformer_layers
from meshboost.plugins.shortcuts import config_from
from meshboost.shardformer import ShardConfig, ShardFormer


class FSDPModel(ModelWrapper):
    """The boosted model: the user's model, sharded in place by FSDP2 (its parameters are DTensors;
    `unwrap()` returns it). `units`: the modules sharded as units of their own, children first."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, units: list[nn.Module]):
        super().__init__(module)
        self.mesh = mesh
        self.units = units

    def no_sync(self):
        """Backward inside the block keeps unreduced gradients (full size) and adds to them; the
        first backward after it reduce-scatters the sum."""
        return no_gradient_sync(self.module)

    def unwrap(self) -> nn.Module:
        """The user's model with every parameter its DTensor shard (what checkpoints read and write)."""
        return reshard_all(super().unwrap())


def _build(precision: str | None = None) -> FSDPConfig:
    return FSDPConfig(PrecisionConfig(precision)) if precision is not None else FSDPConfig()


class FSDPPlugin(Plugin):
    """ZeRO-3 data parallelism over every rank on torch FSDP2, built from `config` (`FSDPConfig`: precision
    and the fp16 scaler, reshard_after_forward, cpu offload, wrap policy, prefetch, kernels; each documented
    on the config). `FSDPPlugin(precision="bf16")` is `FSDPPlugin(FSDPConfig(PrecisionConfig("bf16")))`.
    ColossalAI's GeminiPlugin and TorchFSDPPlugin (their keyword signatures) are compat's subclasses of
    this class, mapping their keywords onto the config (docs/fsdp.md has the table).
    """

    config: FSDPConfig
    # what `configure` returns: a subclass may give its own views of the same objects (compat's GeminiPlugin)
    model_class: type[FSDPModel] = FSDPModel
    optimizer_class: type[FSDPOptimizer] = FSDPOptimizer

    def __init__(self, config: FSDPConfig | None = None, *, precision: str | None = None, **unknown):
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings({"config": config, "precision": precision, **unknown}, f"{type(self).__name__} arguments")
        self._build(config_from("FSDPPlugin", FSDPConfig, _build, config, {"precision": precision}, unknown,
                                "ColossalAI's GeminiPlugin and TorchFSDPPlugin keywords are taken by those classes at "
                                "ColossalAI's path, `from meshboost.booster.plugin import GeminiPlugin, TorchFSDPPlugin` "
                                "(docs/fsdp.md)"))

    def _build(self, config: FSDPConfig) -> None:
        self.config = config
        self.mesh = ParallelMesh()                  # collective: after the checks

    @property
    def precision(self) -> str:
        return self.config.precision.precision

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        # -- pure checks: every rank raises the same error, before any collective ----------------
        name = type(self).__name__
        if isinstance(model, ModelWrapper) or is_sharded(model):
            raise RuntimeError(f"{name}: this model is already sharded by FSDP; boost the original model once")
        if any(p.is_meta for p in model.parameters()):
            raise NotImplementedError(f"{name}: the model has parameters on the meta device; the FSDP2 plugins "
                                      "need real weights (build it normally or with from_pretrained)")
        if isinstance(optimizer, OptimizerWrapper):
            raise TypeError(f"{name}: pass the user's torch optimizer to boost(), not a boosted one")
        names = {id(p): n for n, p in model.named_parameters()}        # the optimizer's, before FSDP2 swaps them
        if optimizer is not None and any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(f"{name}: the optimizer holds parameters that are not the model's; build it on the "
                             "model you boost")
        if self.config.kernels:
            ShardFormer(ShardConfig(enable_tensor_parallelism=False, **self.config.kernels)).optimize(model)
        prepare(model, self.config, self.mesh)
        # in place; parameters become DTensor shards
        units = apply_fsdp(model, self.config, self.mesh, transformer_layers(model))
        if optimizer is not None:      # moved onto the new parameters (a stepped one with its state), then wrapped
            optimizer = boost_optimizer(optimizer, names, model, self.mesh, self.config.precision,
                                        self.optimizer_class)
        return self.model_class(model, self.mesh, units), optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None):
        """Accumulate gradients locally (unreduced, full size) inside the block; see FSDPModel.no_sync."""
        if not isinstance(model, FSDPModel):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        return model.no_sync()
