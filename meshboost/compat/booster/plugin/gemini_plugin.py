"""ColossalAI's path `booster.plugin.gemini_plugin`: `GeminiPlugin` with ColossalAI's keyword signature
(its 41 keywords, in its order), mapped onto the FSDP2 engine's `FSDPConfig` (`fsdp_keywords.gemini_config`:
every keyword honoured on top of FSDP2 or refused naming what to use). Must not hold plugin behaviour:
the class adds nothing but its constructor (and ColossalAI's `tp_size` view) to `meshboost.plugins.FSDPPlugin`.
`GeminiDDP` / `GeminiOptimizer` (ColossalAI's names, which its gemini_plugin module imports too) are the
boosted model and optimizer: the core's `FSDPModel` / `FSDPOptimizer` with ColossalAI's `state_dict(...,
only_rank_0=)`, views built from what the core exports (every rank joins the gathers).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshboost.booster.plugin.fsdp_keywords import gemini_config, settings
from meshboost.distributed.agreement import agree_settings
from meshboost.fsdp import FSDPOptimizer
from meshboost.fsdp.optimizer import full_tensor
from meshboost.plugins import FSDPPlugin
from meshboost.plugins.fsdp import FSDPModel

__all__ = ["GeminiPlugin", "GeminiDDP", "GeminiOptimizer"]


def _here(only_rank_0: bool) -> bool:
    return not only_rank_0 or not dist.is_initialized() or dist.get_rank() == 0


class GeminiDDP(FSDPModel):
    """The model GeminiPlugin boosts: an `FSDPModel` whose `state_dict` is ColossalAI's GeminiDDP's."""

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False, only_rank_0: bool = True):
        """Every parameter and persistent buffer of the user's model as a whole CPU tensor, under the model's own
        names after `prefix` (no wrapper prefix), as ColossalAI's GeminiDDP returns them: on every rank with
        only_rank_0=False, else on global rank 0 (the others get an empty dict). A collective (each FSDP2 shard
        is all-gathered): call it on every rank. keep_vars does not apply (the tensors are gathered copies)."""
        out = OrderedDict() if destination is None else destination
        here = _here(only_rank_0)
        for name, tensor in self.unwrap().state_dict(prefix=prefix, keep_vars=True).items():
            # an offloaded shard is gathered on the mesh's device (NCCL cannot gather CPU tensors)
            whole = full_tensor(tensor, self.mesh.device) if isinstance(tensor, DTensor) else tensor.detach()
            if here:
                out[name] = whole.to("cpu", copy=True)
        return out


class GeminiOptimizer(FSDPOptimizer):
    """The optimizer GeminiPlugin boosts: an `FSDPOptimizer` whose `state_dict` / `load_state_dict` take
    ColossalAI's GeminiOptimizer's (torch's) layout: {"state": {position: {"step", "exp_avg", ...}},
    "param_groups": [{..., "params": [positions]}]}, every tensor whole."""

    def state_dict(self, only_rank_0: bool = True) -> dict:
        """torch's layout with whole CPU tensors (`meshboost.optim.state` entries, flattened); the state on every
        rank with only_rank_0=False, else on global rank 0 (the others get the param groups and no state). A
        collective: call it on every rank. The fp16 loss scale is not part of it (as ColossalAI's)."""
        keys = self._positions()
        here = _here(only_rank_0)
        state = {}
        for key, entry in self.export_state(keys):
            values = {**entry["scalar"], **entry["per_element"]}
            if here and values:
                state[key] = values
        return {"state": state, "param_groups": self.export_meta(keys)["param_groups"]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load torch's layout (this class's `state_dict`, or a torch optimizer's over the same parameters in
        the same order) at any layout, or a meshboost one. Call it on every rank."""
        if not isinstance(state_dict, dict) or "format" in state_dict or set(state_dict) != {"state", "param_groups"}:
            return super().load_state_dict(state_dict)
        keys = self._positions()
        shapes = {key: tuple(p.shape) for p, key in keys.items()}    # DTensors: the whole shape
        entries = {}
        for key, values in state_dict["state"].items():
            whole = {k: v for k, v in values.items()
                     if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) == shapes.get(key)}
            entries[key] = {"per_element": whole, "scalar": {k: v for k, v in values.items() if k not in whole}}
        for key in shapes:                                           # never stepped: no state, as in torch
            entries.setdefault(key, {"per_element": {}, "scalar": {}})
        self.import_state(entries, keys, {"param_groups": state_dict["param_groups"]})


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

    model_class = GeminiDDP
    optimizer_class = GeminiOptimizer

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
