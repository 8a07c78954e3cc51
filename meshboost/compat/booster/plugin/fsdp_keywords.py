"""ColossalAI's path `booster.plugin.fsdp_keywords` (meshboost's own: the mapping of ColossalAI's GeminiPlugin /
TorchFSDPPlugin keyword arguments onto the FSDP2 engine's `FSDPConfig`, meshboost/fsdp/config.py, which
checks its own fields; the core's `meshboost.plugins.FSDPPlugin` takes that config).

Owns: `gemini_config` / `torch_fsdp_config`, which honour every ColossalAI keyword that has a
meaning on top of torch FSDP2 and refuse the others with a message naming what to use instead
(docs/fsdp.md has the table), and `settings`, the arguments as every rank must agree on them.
Every check is pure: the same error on every rank, before any collective. Must not build groups or
touch a model.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy

from meshboost.distributed import get_current_device
from meshboost.fsdp import FSDPConfig
from meshboost.optim import GradScalerConfig, PrecisionConfig, precision_of

logger = logging.getLogger("meshboost.plugins")


def _refuse(name: str, value, why_and_fix: str, error=ValueError):
    raise error(f"{name}={value!r}: {why_and_fix}")


def _stable(value):
    """Enum members by name (agree_settings would compare only their type); a process group by its
    size, which is all the checks read (ranks outside one group hold another of the same size)."""
    if isinstance(value, enum.Enum):
        return str(value)
    if isinstance(value, dist.ProcessGroup):
        return GroupSize(dist.get_world_size(value))
    return value


@dataclass(frozen=True)
class GroupSize:
    """A process group argument, as the checks see it."""

    ranks: int


def settings(args: dict) -> dict:
    """A plugin's keyword arguments as every rank must agree on them (`agree_settings`)."""
    return {k: _stable(v) for k, v in args.items()}


def _fraction(name: str, value) -> bool:
    """Gemini's offload fractions: FSDP2 offloads all of a unit or nothing, so 0 or 1 only."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        _refuse(name, value, "must be a number in [0, 1]")
    if value not in (0, 1):
        _refuse(name, value, "FSDP2 offloads whole shards (CPUOffloadPolicy: weights, gradients and optimizer "
                "states together), not a fraction; pass 0.0 (everything on the device) or 1.0 (offload)")
    return value == 1


def gemini_config(a: dict) -> FSDPConfig:
    """FSDPConfig from GeminiPlugin's keyword arguments `a` (ColossalAI's names and defaults)."""
    if a["tp_size"] != 1:
        _refuse("tp_size", a["tp_size"], "GeminiPlugin shards over data-parallel ranks only; for tensor parallelism "
                f"with ZeRO-3 use HybridParallelPlugin(tp_size={a['tp_size']}, zero_stage=3, precision=...) (the "
                "same FSDP2 sharding over the data-parallel ranks of each tensor-parallel shard), or zero_stage=1 "
                "or 2 to shard only optimizer states (and gradients)", NotImplementedError)
    if a["extra_dp_size"] != 1:
        _refuse("extra_dp_size", a["extra_dp_size"], "hybrid sharding (replicas of sharded groups) is not "
                "supported: every rank shards the model; pass extra_dp_size=1", NotImplementedError)
    if a["placement_policy"] not in ("static", "auto"):
        _refuse("placement_policy", a["placement_policy"], "expected 'static' or 'auto'")
    if a["placement_policy"] == "auto":
        # Gemini's "auto" moves chunks between host and device as memory runs short, never changing a
        # number; FSDP2 has no runtime placement, so everything stays on the device (the same as "auto"
        # where memory suffices). Its tuning knobs are accepted; offloading is asked for explicitly.
        if a["offload_optim_frac"] or a["offload_param_frac"]:
            _refuse("placement_policy", "auto", "the offload fractions belong to placement_policy='static'; pass "
                    "placement_policy='static' with offload_optim_frac=1.0")
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("meshboost GeminiPlugin: placement_policy='auto' keeps every shard on the device (FSDP2 "
                           "has no runtime placement); if memory runs out, use placement_policy='static', "
                           "offload_optim_frac=1.0, offload_param_frac=1.0")
    else:
        for name, default in (("warmup_non_model_data_ratio", 0.8), ("steady_cuda_cap_ratio", 0.9),
                              ("memstats", None), ("gpu_margin_mem_ratio", 0.0)):
            if a[name] != default:
                _refuse(name, a[name], "it tunes placement_policy='auto'; remove it with placement_policy='static'")
    for name in ("chunk_config_dict", "hidden_dim"):
        if a[name] is not None:
            _refuse(name, a[name], "FSDP2 has no chunks: each transformer layer is one fully_shard unit; remove it")
    for name, default in (("search_range_m", 32), ("min_chunk_size_m", 32)):
        if a[name] != default:
            _refuse(name, a[name], "FSDP2 has no chunks: each transformer layer is one fully_shard unit; remove it")
    device = a["chunk_init_device"]
    if device is not None and torch.device(device).type != get_current_device().type:
        _refuse("chunk_init_device", device, f"shards live on this process's device ({get_current_device().type}), "
                "or on the CPU with offload_optim_frac=offload_param_frac=1.0; remove it")
    if a["shard_param_frac"] not in (0, 1) or isinstance(a["shard_param_frac"], bool):
        _refuse("shard_param_frac", a["shard_param_frac"], "FSDP2 shards every weight; pass 1.0 (gathered weights "
                "freed after forward, ZeRO-3) or 0.0 (kept until backward ends, like ZeRO-2)")
    offload = _fraction("offload_optim_frac", a["offload_optim_frac"])
    offload_param = _fraction("offload_param_frac", a["offload_param_frac"])
    if offload_param and not offload:
        _refuse("offload_param_frac", a["offload_param_frac"], "offloading weights keeps the optimizer step on the "
                "CPU too (FSDP2's CPUOffloadPolicy); pass offload_optim_frac=1.0 as well")
    if not a["master_weights"]:
        _refuse("master_weights", False, "FSDP2 keeps the sharded weights in fp32 and they are what the optimizer "
                "steps; pass master_weights=True")
    if a["precision"] not in ("fp16", "bf16", "fp32"):
        _refuse("precision", a["precision"], "expected 'fp16', 'bf16' or 'fp32'")
    if not a["enable_async_reduce"]:
        _refuse("enable_async_reduce", False, "FSDP2 always reduce-scatters on its own stream while backward "
                "goes on; remove it")
    for name in ("use_fp8", "fp8_communication"):
        if a[name]:
            _refuse(name, True, "fp8 is not supported; remove it", NotImplementedError)
    if a["enable_sequence_parallelism"]:
        _refuse("enable_sequence_parallelism", True, "sequence parallelism splits over tensor-parallel ranks; use "
                "HybridParallelPlugin(tp_size>1, enable_sequence_parallelism=True)", NotImplementedError)
    precision = PrecisionConfig(a["precision"], a["max_norm"], a["norm_type"], GradScalerConfig(
        a["initial_scale"], a["min_scale"], a["growth_factor"], a["backoff_factor"], a["growth_interval"],
        a["hysteresis"], a["max_scale"], a["max_skips_at_min_scale"]))
    kernels = {k: a[k] for k in ("enable_all_optimization", "enable_fused_normalization", "enable_flash_attention",
                                 "enable_jit_fused") if a[k]}
    return FSDPConfig(precision, reshard_after_forward=a["shard_param_frac"] == 1, cpu_offload=offload,
                      pin_memory=bool(a["pin_memory"]), output_dtype=torch.float32 if a["force_outputs_fp32"] else None,
                      forward_prefetch=a["max_prefetch"], kernels=kernels, verbose=bool(a["verbose"]))


def _mixed_precision(mp) -> dict:
    """FSDPConfig fields from TorchFSDPPlugin's `mixed_precision` (FSDP1's MixedPrecision, or FSDP2's
    MixedPrecisionPolicy)."""
    if mp is None:
        return {"precision": "fp32", "cast_buffers": False}
    if isinstance(mp, MixedPrecisionPolicy):      # FSDP2 leaves buffers alone
        out = {"param_dtype": mp.param_dtype, "reduce_dtype": mp.reduce_dtype, "output_dtype": mp.output_dtype,
               "cast_forward_inputs": mp.cast_forward_inputs, "cast_buffers": False}
    elif isinstance(mp, MixedPrecision):
        if mp.keep_low_precision_grads:
            _refuse("MixedPrecision.keep_low_precision_grads", True, "FSDP2 hands the optimizer fp32 gradient "
                    "shards (the weights' dtype); remove it")
        out = {"param_dtype": mp.param_dtype, "reduce_dtype": mp.reduce_dtype, "buffer_dtype": mp.buffer_dtype,
               "cast_buffers": mp.buffer_dtype is not None,        # FSDP1: None leaves buffers as they are
               "cast_forward_inputs": mp.cast_forward_inputs or mp.cast_root_forward_inputs}
    else:
        raise TypeError(f"mixed_precision={mp!r}: pass torch.distributed.fsdp.MixedPrecision(param_dtype=..., "
                        "reduce_dtype=..., buffer_dtype=...) or MixedPrecisionPolicy(...), or None for fp32")
    for key in ("param_dtype", "reduce_dtype", "buffer_dtype", "output_dtype"):
        if out.get(key) is not None and precision_of(out[key]) is None:
            _refuse(f"mixed_precision.{key}", out[key], "expected torch.float16, torch.bfloat16, torch.float32 or None")
    param_dtype = out.pop("param_dtype")
    out["precision"] = "fp32" if param_dtype is None else precision_of(param_dtype)
    return out


def torch_fsdp_config(a: dict) -> FSDPConfig:
    """FSDPConfig from TorchFSDPPlugin's keyword arguments `a` (FSDP1's, as ColossalAI passes them)."""
    from torch.distributed.fsdp import BackwardPrefetch, ShardingStrategy

    group = a["process_group"]
    if group is not None and dist.get_world_size(group) != dist.get_world_size():
        _refuse("process_group", _stable(group), "the FSDP2 plugins shard over every rank (a data-parallel-only "
                "mesh); pass process_group=None", NotImplementedError)
    strategy = a["sharding_strategy"]
    if strategy not in (None, ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        fix = ("use TorchDDPPlugin for plain data parallelism" if strategy == ShardingStrategy.NO_SHARD else
               "hybrid sharding is not supported; use ShardingStrategy.FULL_SHARD or SHARD_GRAD_OP")
        _refuse("sharding_strategy", strategy, fix, NotImplementedError)
    offload = a["cpu_offload"]
    if isinstance(offload, CPUOffload):
        offload, pin = offload.offload_params, False
    elif isinstance(offload, CPUOffloadPolicy):
        offload, pin = True, offload.pin_memory
    elif offload is None or isinstance(offload, bool):
        offload, pin = bool(offload), False
    else:
        raise TypeError(f"cpu_offload={offload!r}: pass CPUOffload(offload_params=True), FSDP2's CPUOffloadPolicy(), "
                        "True or None")
    if a["backward_prefetch"] not in (None, *BackwardPrefetch):
        raise TypeError(f"backward_prefetch={a['backward_prefetch']!r}: pass None or a BackwardPrefetch member")
    if a["backward_prefetch"] == BackwardPrefetch.BACKWARD_POST:
        _refuse("backward_prefetch", a["backward_prefetch"], "FSDP2 prefetches the next layer's all-gather before "
                "the current layer's gradients (BACKWARD_PRE); pass BackwardPrefetch.BACKWARD_PRE or None")
    if a["param_init_fn"] is not None:
        _refuse("param_init_fn", a["param_init_fn"], "meta-device initialisation is not supported by the FSDP2 "
                "plugins; build the model with its weights (e.g. from_pretrained) and pass param_init_fn=None",
                NotImplementedError)
    if a["fp8_communication"]:
        _refuse("fp8_communication", True, "fp8 is not supported; remove it", NotImplementedError)
    ignored = tuple(a["ignored_modules"] or ())
    if not all(isinstance(m, torch.nn.Module) for m in ignored):
        raise TypeError("ignored_modules must be an iterable of nn.Module")
    mp = _mixed_precision(a["mixed_precision"])
    precision = PrecisionConfig(mp.pop("precision"), a["max_norm"], a["norm_type"], GradScalerConfig(
        a["initial_scale"], a["min_scale"], a["growth_factor"], a["backoff_factor"], a["growth_interval"],
        a["hysteresis"], a["max_scale"], a["max_skips_at_min_scale"]))
    return FSDPConfig(precision, reshard_after_forward=strategy != ShardingStrategy.SHARD_GRAD_OP,
                      cpu_offload=offload, pin_memory=pin, auto_wrap_policy=a["auto_wrap_policy"],
                      sync_module_states=a["sync_module_states"], ignored_modules=ignored, **mp)
