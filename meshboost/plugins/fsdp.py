"""GeminiPlugin and TorchFSDPPlugin: ZeRO-3 data parallelism on torch FSDP2 (`fully_shard`).

Owns: the wiring only. Weights, gradients and optimizer states are sharded over every rank (a
dp-only mesh) by the FSDP2 engine (meshboost.fsdp), one unit per transformer layer
(`fsdp_wrap.transformer_layers`) plus the root; mixed precision is FSDP2's MixedPrecisionPolicy (fp32
sharded weights are the masters), CPU offload its CPUOffloadPolicy; the step (fp16 loss scale,
clipping by the global norm over the shards) is `FSDPOptimizer`'s. ColossalAI's keyword arguments map
onto the engine's `FSDPConfig` (`fsdp_config.py`, the table in docs/fsdp.md). Must not implement
sharding, reduction or checkpoint formats: meshboost.fsdp, meshboost.optim and meshboost.checkpoint do.
"""

from __future__ import annotations

import torch.nn as nn

from meshboost.booster import ModelWrapper, OptimizerWrapper, Plugin
from meshboost.distributed import ParallelMesh
from meshboost.distributed.agreement import agree_settings
from meshboost.fsdp import FSDPConfig, apply_fsdp, boost_optimizer, is_sharded, no_gradient_sync, prepare, reshard_all
from meshboost.plugins.fsdp_config import gemini_config, settings, torch_fsdp_config
from meshboost.plugins.fsdp_wrap import transformer_layers
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


class FSDPPluginBase(Plugin):
    """What GeminiPlugin and TorchFSDPPlugin share: build from an `FSDPConfig` over a dp-only mesh."""

    config: FSDPConfig

    def _build(self, config: FSDPConfig) -> None:
        self.config = config
        self.mesh = ParallelMesh(tp_size=1, pp_size=1)                  # collective: after the checks

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
            optimizer = boost_optimizer(optimizer, names, model, self.mesh, self.config.precision)
        return FSDPModel(model, self.mesh, units), optimizer, criterion, dataloader, lr_scheduler

    def no_sync(self, model, optimizer=None):
        """Accumulate gradients locally (unreduced, full size) inside the block; see FSDPModel.no_sync."""
        if not isinstance(model, FSDPModel):
            raise TypeError("no_sync needs the model returned by booster.boost(...)")
        return model.no_sync()


class GeminiPlugin(FSDPPluginBase):
    """ColossalAI's GeminiPlugin (ZeRO-3 with chunked placement) on torch FSDP2, over every rank.

    Honoured: precision ("fp16" loss-scaled, "bf16", and "fp32"), initial_scale ... max_scale (the fp16
    loss scaler; meshboost adds max_skips_at_min_scale), max_norm / norm_type (global-norm clipping),
    placement_policy="static" with offload_optim_frac / offload_param_frac 0.0 or 1.0 (FSDP2's
    CPUOffloadPolicy: weights, gradients and the optimizer step on the CPU), shard_param_frac 1.0
    (ZeRO-3) or 0.0 (weights kept gathered from forward to backward), pin_memory, force_outputs_fp32,
    max_prefetch (forward all-gathers issued ahead), enable_gradient_accumulation (always possible;
    `booster.no_sync` too), strict_ddp_mode, verbose, and the kernel switches enable_flash_attention,
    enable_fused_normalization, enable_jit_fused, enable_all_optimization (meshboost.shardformer).
    Refused with the meshboost way named: tp_size > 1, extra_dp_size > 1, placement_policy="auto" and
    its knobs, chunk settings, fractional offload, master_weights=False, enable_async_reduce=False,
    fp8, sequence parallelism. docs/fsdp.md has the table.
    """

    def __init__(self, chunk_config_dict: dict | None = None, chunk_init_device=None, placement_policy: str = "static",
                 enable_gradient_accumulation: bool = False, max_prefetch: int = 0, shard_param_frac: float = 1.0,
                 offload_optim_frac: float = 0.0, offload_param_frac: float = 0.0,
                 warmup_non_model_data_ratio: float = 0.8, steady_cuda_cap_ratio: float = 0.9,
                 precision: str = "fp16", master_weights: bool = True, pin_memory: bool = False,
                 force_outputs_fp32: bool = False, strict_ddp_mode: bool = False, search_range_m: int = 32,
                 hidden_dim: int | None = None, min_chunk_size_m: float = 32, memstats=None,
                 gpu_margin_mem_ratio: float = 0.0, initial_scale: float = 2**16, min_scale: float = 1,
                 growth_factor: float = 2, backoff_factor: float = 0.5, growth_interval: int = 1000,
                 hysteresis: int = 2, max_scale: float = 2**32, max_norm: float = 0.0, norm_type: float = 2.0,
                 tp_size: int = 1, extra_dp_size: int = 1, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_sequence_parallelism: bool = False, enable_jit_fused: bool = False,
                 enable_async_reduce: bool = True, use_fp8: bool = False, verbose: bool = False,
                 fp8_communication: bool = False, max_skips_at_min_scale: int = 50):
        args = {k: v for k, v in locals().items() if k != "self"}
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings(settings(args), "GeminiPlugin arguments")
        self._build(gemini_config(args))

    @property
    def tp_size(self) -> int:
        return 1


class TorchFSDPPlugin(FSDPPluginBase):
    """ColossalAI's TorchFSDPPlugin (FSDP1's arguments) on torch FSDP2, over every rank.

    sharding_strategy: FULL_SHARD (default) or SHARD_GRAD_OP (weights kept gathered from forward to
    backward); mixed_precision: FSDP1's MixedPrecision (param_dtype -> compute dtype, float16 with
    meshboost's dynamic loss scaler; reduce_dtype; buffer_dtype: floating buffers cast at boost) or
    FSDP2's MixedPrecisionPolicy; None trains in fp32. cpu_offload: CPUOffload(offload_params=True),
    CPUOffloadPolicy() or True. auto_wrap_policy: an FSDP1 policy (None: one unit per transformer
    layer). backward_prefetch: None or BACKWARD_PRE (FSDP2's own). ignored_modules, sync_module_states
    as in FSDP1. meshboost adds max_norm / norm_type (global-norm clipping over the shards) and the
    fp16 loss scaler's initial_scale ... max_skips_at_min_scale. Refused with the way out named:
    process groups smaller than the world, NO_SHARD / hybrid strategies, BACKWARD_POST,
    param_init_fn, fp8_communication. docs/fsdp.md has the table.
    """

    def __init__(self, process_group=None, sharding_strategy=None, cpu_offload=None, auto_wrap_policy=None,
                 backward_prefetch=None, mixed_precision=None, ignored_modules=None, param_init_fn=None,
                 sync_module_states: bool = False, fp8_communication: bool = False, max_norm: float = 0.0,
                 norm_type: float = 2.0, initial_scale: float = 2**16, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32, max_skips_at_min_scale: int = 50):
        args = {k: v for k, v in locals().items() if k != "self"}
        agree_settings(settings(args), "TorchFSDPPlugin arguments")
        self._build(torch_fsdp_config(args))
