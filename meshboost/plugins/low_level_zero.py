"""LowLevelZeroPlugin: data parallelism with ZeRO stage 1 or 2 and no model parallelism.

Owns: the wiring only (a dp-only mesh, device placement, the working-dtype cast of weights and
floating-point inputs, the ZeroOptimizer around the user's optimizer), built from one typed
`LowLevelZeroConfig`. ColossalAI's 23 keywords are compat's (compat/booster/plugin/low_level_zero_plugin.py),
mapped onto this config. The optimizer is the very ZeroOptimizer that
HybridParallelPlugin(zero_stage=...) uses; nothing here reduces, scales, clips or offloads by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh
from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.inputs import cast_floating
from meshboost.distributed.quantized import cast_keeping_nf4
from meshboost.optim import PrecisionConfig, ZeroConfig, ZeroOptimizer
from meshboost.plugins.shortcuts import config_from


class LowLevelZeroModel(ModelWrapper):
    """The boosted model: the user's model in the working dtype (ZeRO reduces its gradients).
    input_dtype: floating-point inputs are cast to it (None: left as they are)."""

    def __init__(self, module: nn.Module, mesh: ParallelMesh, input_dtype: torch.dtype | None = None):
        super().__init__(module)
        self.mesh = mesh
        self.input_dtype = input_dtype

    def forward(self, *args, **kwargs):
        return self.module(*cast_floating(args, self.input_dtype), **cast_floating(kwargs, self.input_dtype))


@dataclass(frozen=True)
class LowLevelZeroConfig:
    """What LowLevelZeroPlugin builds, checked when constructed (before any collective).

    zero: `ZeroConfig` with stage 1 (optimizer states and fp32 masters partitioned over every rank) or 2
        (gradients too), buckets, overlap, offload, communication dtype, master weights.
    precision: `PrecisionConfig` (working precision, clipping, fp16's loss scale); fp16 by default, as
        ColossalAI's plugin.
    cast_inputs: cast floating-point inputs to the working dtype (fp16/bf16) on every call.
    verbose: rank 0 logs skipped fp16 steps (logger "meshboost.optim", INFO).
    """

    zero: ZeroConfig = field(default_factory=lambda: ZeroConfig(stage=1))
    precision: PrecisionConfig = field(default_factory=lambda: PrecisionConfig("fp16"))
    cast_inputs: bool = True
    verbose: bool = False

    def __post_init__(self):
        if not isinstance(self.zero, ZeroConfig) or not isinstance(self.precision, PrecisionConfig):
            raise TypeError(f"LowLevelZeroConfig(zero={self.zero!r}, precision={self.precision!r}): pass "
                            "zero=meshboost.optim.ZeroConfig(stage=1 or 2) and precision=meshboost.optim.PrecisionConfig(...)")
        if not self.zero.partitioned_by_optimizer:      # a valid stage (the config says), not this plugin's
            raise ValueError(f"stage={self.zero.stage!r}; LowLevelZeroPlugin supports ZeRO stage 1 or 2 "
                             "(use TorchDDPPlugin for plain data parallelism, HybridParallelPlugin(zero_stage=3) "
                             "for ZeRO-3)")

    @classmethod
    def of(cls, stage: int = 1, precision: str = "fp16") -> LowLevelZeroConfig:
        """The config of the plugin's shortcuts (`LowLevelZeroPlugin(stage=2, precision="bf16")`)."""
        return cls(zero=ZeroConfig(stage=stage), precision=PrecisionConfig(precision))


class LowLevelZeroPlugin(Plugin):
    """ZeRO data parallelism over every rank, built from `config` (`LowLevelZeroConfig`: the `ZeroConfig`,
    the `PrecisionConfig`, cast_inputs, verbose). `LowLevelZeroPlugin(stage=2, precision="bf16")` is
    `LowLevelZeroPlugin(LowLevelZeroConfig.of(...))`. ColossalAI's keywords (its 23, in its order) are
    taken by the class at ColossalAI's path, `meshboost.booster.plugin.LowLevelZeroPlugin` (compat),
    which maps them onto this config.
    """

    def __init__(self, config: LowLevelZeroConfig | None = None, *, stage: int | None = None,
                 precision: str | None = None, **unknown):
        shortcuts = dict(stage=stage, precision=precision)
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings({"config": config, **shortcuts, **unknown}, "LowLevelZeroPlugin arguments")
        # -- pure checks first: every rank raises the same error before any collective ----------
        self.config = config_from("LowLevelZeroPlugin", LowLevelZeroConfig, LowLevelZeroConfig.of, config, shortcuts,
                                  unknown, "ColossalAI's keywords are taken by `from meshboost.booster.plugin import "
                                  "LowLevelZeroPlugin`, ColossalAI's path, which maps them onto the config "
                                  "(docs/colossalai.md)")
        self.mesh = ParallelMesh()                  # collective: after the checks

    @property
    def precision_config(self) -> PrecisionConfig:
        return self.config.precision

    @property
    def zero_config(self) -> ZeroConfig:
        return self.config.zero

    @property
    def verbose(self) -> bool:
        return self.config.verbose

    @property
    def cast_inputs(self) -> bool:
        return self.config.cast_inputs

    @property
    def precision(self) -> str:
        return self.precision_config.precision

    @property
    def stage(self) -> int:
        return self.zero_config.stage

    def configure(self, model: nn.Module, optimizer=None, criterion=None, dataloader=None, lr_scheduler=None):
        # A model built under torch.device("meta") stays there until booster.load_model materialises it
        # (the masters are filled then: ZeroOptimizer.sync_masters_from_model).
        if not any(p.is_meta for p in model.parameters()):
            model = model.to(self.mesh.device)     # in place: the optimizer's parameters stay the same objects
        if optimizer is not None and not isinstance(optimizer, OptimizerWrapper):
            optimizer = ZeroOptimizer(optimizer, self.mesh, self.precision_config, self.zero_config,
                                      verbose=self.verbose)
        model = cast_keeping_nf4(model, self.precision_config.dtype)   # after the masters copied the fp32 weights
        input_dtype = self.precision_config.dtype if self.cast_inputs else None
        return LowLevelZeroModel(model, self.mesh, input_dtype), optimizer, criterion, dataloader, lr_scheduler

    def lora_refusal(self) -> None:
        return None                       # ZeRO partitions the trainable adapters; the frozen base is left alone

    def no_sync(self, model, optimizer=None):
        """Stage 1: gradients stay local until step. Stage 2: an error (ZeroOptimizer.no_sync says why)."""
        if not isinstance(optimizer, ZeroOptimizer):
            raise TypeError("no_sync needs the boosted optimizer: booster.no_sync(model, optimizer)")
        return optimizer.no_sync()
