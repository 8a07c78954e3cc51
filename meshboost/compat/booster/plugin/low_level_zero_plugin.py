"""ColossalAI's path `booster.plugin.low_level_zero_plugin`: `LowLevelZeroPlugin` with ColossalAI's
keyword signature (its 23 keywords, in its order), a thin mapping onto meshboost's `LowLevelZeroConfig`.

Owns: `colossalai_config` (keywords -> config) and the refusals of ColossalAI keywords meshboost does
not implement, each naming the meshboost way to get what it is for. Every check is pure (the same error
on every rank, after one agreement over the arguments, before any other collective). Must not hold
plugin behaviour: the class adds nothing but its constructor to `meshboost.plugins.LowLevelZeroPlugin`.
"""

from __future__ import annotations

import torch

from meshboost.distributed.agreement import agree_settings
from meshboost.optim import GradScalerConfig, PrecisionConfig, ZeroConfig, bucket_elements
from meshboost.plugins import LowLevelZeroConfig
from meshboost.plugins import LowLevelZeroPlugin as CorePlugin

__all__ = ["LowLevelZeroPlugin", "colossalai_config"]


def _refuse_unsupported(overlap_allgather, fp8_communication, use_fp8, extra_dp_size) -> None:
    """ColossalAI keywords meshboost does not implement: refused (pure, the same on every rank) with the
    meshboost way to get what they are for."""
    if overlap_allgather:
        raise NotImplementedError(
            "overlap_allgather=True is not supported: meshboost all-gathers the updated shards inside "
            "optimizer.step() (one all-gather per bucket over dp), not lazily during the next forward. Drop the "
            "argument (training is the same); overlap_communication=True overlaps the gradient reduce-scatter "
            "with backward")
    if use_fp8:
        raise NotImplementedError("use_fp8=True (fp8 matmuls) is not supported by LowLevelZeroPlugin; use "
                                  "HybridParallelPlugin(use_fp8=True, zero_stage=1 or 2), or train with "
                                  "precision='bf16' or 'fp16'")
    if fp8_communication:
        raise NotImplementedError("fp8_communication=True is not supported; communication_dtype=torch.bfloat16 "
                                  "(or torch.float16) reduce-scatters the gradients in 16 bits")
    if not isinstance(extra_dp_size, int) or isinstance(extra_dp_size, bool) or extra_dp_size < 1:
        raise ValueError(f"extra_dp_size={extra_dp_size!r} must be a positive integer (1: partition over every rank)")
    if extra_dp_size > 1:
        raise NotImplementedError(
            f"extra_dp_size={extra_dp_size} (ZeRO partitioned within groups of world/extra_dp_size ranks and "
            "replicated across them) is not supported: meshboost's LowLevelZeroPlugin partitions masters and "
            "optimizer states over every rank (1/world of them per rank). Use extra_dp_size=1")


def colossalai_config(a: dict) -> LowLevelZeroConfig:
    """ColossalAI's LowLevelZeroPlugin keywords (a dict of them) as meshboost's config (pure)."""
    _refuse_unsupported(a["overlap_allgather"], a["fp8_communication"], a["use_fp8"], a["extra_dp_size"])
    precision = PrecisionConfig(a["precision"], a["max_norm"], a["norm_type"], GradScalerConfig(
        a["initial_scale"], a["min_scale"], a["growth_factor"], a["backoff_factor"], a["growth_interval"],
        a["hysteresis"], a["max_scale"], a["max_skips_at_min_scale"]))
    zero = ZeroConfig(a["stage"], a["overlap_communication"],
                      bucket_elements(a["reduce_bucket_size_in_m"], "reduce_bucket_size_in_m"), a["cpu_offload"],
                      a["communication_dtype"], a["master_weights"])
    return LowLevelZeroConfig(zero=zero, precision=precision, cast_inputs=bool(a["cast_inputs"]),
                              verbose=bool(a["verbose"]))


class LowLevelZeroPlugin(CorePlugin):
    """ColossalAI's LowLevelZeroPlugin: ZeRO data parallelism over every rank. The keywords are ColossalAI's,
    in its order:

    stage: 1 (optimizer states and fp32 masters partitioned) or 2 (gradients too).
    precision: "fp16" (loss-scaled) | "bf16" | "fp32". initial_scale ... max_scale (and the keyword-only
        max_skips_at_min_scale): the fp16 loss scaler. max_norm / norm_type: global-norm clipping when
        max_norm > 0 (norm_type 2.0 or inf). (`meshboost.optim.PrecisionConfig`)
    reduce_bucket_size_in_m: bucket size in millions of elements; communication_dtype: dtype of the
        gradient reduce-scatter (None: the working dtype); overlap_communication: reduce-scatter buckets
        from gradient hooks during backward; cpu_offload: fp32 master shards and optimizer states in CPU
        memory, the inner step on the CPU (gradient shard down, updated shard up each step);
        master_weights=False: no fp32 masters, the inner optimizer steps working-dtype shards.
        (`meshboost.optim.ZeroConfig`, docs/precision_and_zero.md)
    verbose: rank 0 logs skipped fp16 steps (logger "meshboost.optim", INFO).
    cast_inputs: cast floating-point inputs to the working dtype (fp16/bf16) on every call.
    overlap_allgather, fp8_communication, use_fp8, extra_dp_size > 1: refused with the alternative.
    """

    def __init__(self, stage: int = 1, precision: str = "fp16", initial_scale: float = 2**16,
                 min_scale: float = 1, growth_factor: float = 2, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2, max_scale: float = 2**32,
                 max_norm: float = 0.0, norm_type: float = 2.0, reduce_bucket_size_in_m: int = 12,
                 communication_dtype: torch.dtype | None = None, overlap_communication: bool = True,
                 overlap_allgather: bool = False, cpu_offload: bool = False, master_weights: bool = True,
                 verbose: bool = False, cast_inputs: bool = True, fp8_communication: bool = False,
                 use_fp8: bool = False, extra_dp_size: int = 1, *, max_skips_at_min_scale: int = 50):
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        # Every rank must pass the same arguments; one all-gather of a digest says so (or names the
        # difference) before anything that could differ by rank, so no rank is left hanging.
        agree_settings(args, "LowLevelZeroPlugin arguments")
        super().__init__(colossalai_config(args))
