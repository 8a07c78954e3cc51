"""What the FSDP2 engine builds: `FSDPConfig`, typed and checked when constructed.

Owns: the engine's settings (precision and clipping, resharding, CPU offload, mixed-precision dtypes,
how the model is cut into `fully_shard` units, kernel switches) and the FSDP2 policies they make.
Every check is pure: the same error on every rank, before any collective. Must not know any
plugin's keyword arguments (compat/booster/plugin/fsdp_keywords.py maps ColossalAI's onto this), build groups or
touch a model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

from meshboost.optim import PrecisionConfig


@dataclass
class FSDPConfig:
    """The FSDP2 build, checked when constructed."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)  # compute dtype, max_norm, fp16 scaler
    reshard_after_forward: bool = True    # free gathered weights after forward (ZeRO-3); False: after backward
    cpu_offload: bool = False             # sharded weights, grads and optimizer step on the CPU (CPUOffloadPolicy)
    pin_memory: bool = False              # pin the offloaded shards (CUDA only)
    reduce_dtype: torch.dtype | None = torch.float32  # gradient reduce-scatter dtype (None: the compute dtype)
    output_dtype: torch.dtype | None = None           # the root's floating outputs are cast to this
    cast_forward_inputs: bool = True      # each unit casts its floating inputs to the compute dtype
    # floating buffers (rotary inv_freq, ...) are cast at boost to buffer_dtype, None: the compute dtype, as the
    # other plugins' model.to(dtype) and ColossalAI's GeminiDDP cast them; cast_buffers=False keeps their dtype
    # (FSDP1's MixedPrecision(buffer_dtype=None), which TorchFSDPPlugin follows)
    buffer_dtype: torch.dtype | None = None
    cast_buffers: bool = True
    auto_wrap_policy: Callable | None = None          # FSDP1-style policy; None: one unit per layer
    forward_prefetch: int = 0             # all-gather the next k layer units during a layer's forward
    sync_module_states: bool = False      # broadcast rank 0's weights and buffers before sharding
    ignored_modules: tuple = ()           # their parameters stay whole and unreduced (FSDP's ignored_modules)
    kernels: dict = field(default_factory=dict)       # ShardConfig kernel switches (flash attention, ...)
    verbose: bool = False                 # rank 0 logs the units and the policies

    def __post_init__(self):
        if not isinstance(self.forward_prefetch, int) or isinstance(self.forward_prefetch, bool) \
                or self.forward_prefetch < 0:
            raise ValueError(f"max_prefetch={self.forward_prefetch!r} must be a non-negative integer")
        if self.auto_wrap_policy is not None and not callable(self.auto_wrap_policy):
            raise TypeError(f"auto_wrap_policy={self.auto_wrap_policy!r} must be callable like FSDP1's policies "
                            "(module, recurse, nonwrapped_numel) -> bool, e.g. functools.partial("
                            "transformer_auto_wrap_policy, transformer_layer_cls={...}) or ModuleWrapPolicy({...}); "
                            "None wraps every transformer layer")

    @property
    def dtype(self) -> torch.dtype:
        return self.precision.dtype

    def mp_policy(self, root: bool) -> MixedPrecisionPolicy:
        """FSDP2's mixed precision: sharded weights stay fp32 (they are the masters), compute in `dtype`."""
        return MixedPrecisionPolicy(param_dtype=self.dtype if self.dtype != torch.float32 else None,
                                    reduce_dtype=self.reduce_dtype,
                                    output_dtype=self.output_dtype if root else None,
                                    cast_forward_inputs=self.cast_forward_inputs)

    def offload_policy(self):
        return CPUOffloadPolicy(pin_memory=self.pin_memory and torch.cuda.is_available()) if self.cpu_offload \
            else None
