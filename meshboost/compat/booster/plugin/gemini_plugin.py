"""ColossalAI's path `booster.plugin.gemini_plugin`: `GeminiPlugin` with ColossalAI's keyword signature
(its 41 keywords, in its order), mapped onto the FSDP2 engine's `FSDPConfig` (`fsdp_keywords.gemini_config`:
every keyword honoured on top of FSDP2 or refused naming what to use). Must not hold plugin behaviour:
the class adds nothing but its constructor (and ColossalAI's `tp_size` view) to `meshboost.plugins.FSDPPlugin`.
"""

from __future__ import annotations

from meshboost.booster.plugin.fsdp_keywords import gemini_config, settings
from meshboost.distributed.agreement import agree_settings
from meshboost.plugins import FSDPPlugin

__all__ = ["GeminiPlugin"]


class GeminiPlugin(FSDPPlugin):
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
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings(settings(args), "GeminiPlugin arguments")
        self._build(gemini_config(args))

    @property
    def tp_size(self) -> int:
        return 1
