"""ColossalAI's path `booster.plugin.torch_fsdp_plugin`: `TorchFSDPPlugin` with ColossalAI's keyword
signature (FSDP1's arguments, its 20 keywords), mapped onto the FSDP2 engine's `FSDPConfig`
(`fsdp_keywords.torch_fsdp_config`). Must not hold plugin behaviour: the class adds nothing but its
constructor to `meshboost.plugins.FSDPPlugin`.
"""

from __future__ import annotations

from meshboost.booster.plugin.fsdp_keywords import settings, torch_fsdp_config
from meshboost.distributed.agreement import agree_settings
from meshboost.plugins import FSDPPlugin

__all__ = ["TorchFSDPPlugin"]


class TorchFSDPPlugin(FSDPPlugin):
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
        args = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        agree_settings(settings(args), "TorchFSDPPlugin arguments")
        self._build(torch_fsdp_config(args))
