"""ColossalAI's path `booster.plugin.moe_hybrid_parallel_plugin`: `MoeHybridParallelPlugin` with ColossalAI's
MoE signature (tp_size, pp_size, ep_size, then its keywords in its order), a thin mapping onto meshboost's
`HybridParallelConfig`: the keywords it shares with HybridParallelPlugin go through that plugin's
`colossalai_config`, `ep_size` lands in `HybridParallelConfig.ep_size`. `HybridParallelPlugin` is
re-exported (ColossalAI's scripts import both names from this module).

Owns: `moe_colossalai_config` (MoE keywords -> config) and the refusals of the MoE keywords meshboost does
not implement. Every check is pure (the same error on every rank, after one agreement over the arguments,
before any other collective); whether ep_size divides the data-parallel size is the mesh's check, not
repeated here. Must not hold plugin behaviour: expert parallelism is `meshboost.plugins.HybridParallelPlugin`'s
(`ep_group`, `moe_dp_group` and `ep_size` are its properties); the class adds its constructor, ColossalAI's
views of the mesh and `moe_dp_size`.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from meshboost.booster.plugin.hybrid_parallel_plugin import (
    HybridParallelModule,
    HybridParallelPlugin,
    colossalai_config,
)
from meshboost.distributed.agreement import agree_settings
from meshboost.plugins import HybridParallelPlugin as CorePlugin
from meshboost.plugins.config import DDP_BUCKET_CAP_MB, HybridParallelConfig
from meshboost.shardformer import PipelineGradientCheckpointConfig, Policy

__all__ = ["HybridParallelModule", "HybridParallelPlugin", "MoeHybridParallelPlugin", "moe_colossalai_config"]

# MoE-only keywords: mapped or refused here, never passed on to `colossalai_config`
MOE_KEYWORDS = ("ep_size", "moe_dp_outside", "moe_tp_size")

# HybridParallelPlugin keywords ColossalAI's MoE signature lacks: HybridParallelPlugin's own defaults
_HYBRID_DEFAULTS = {k: p.default for k, p in inspect.signature(HybridParallelPlugin.__init__).parameters.items()
                    if k not in ("self", "tp_size")}


def _refuse_moe(tp_size, moe_tp_size, moe_dp_outside, enable_sequence_parallelism, sequence_parallelism_mode) -> None:
    """MoE keywords (and MoE defaults) meshboost does not implement: refused (pure) with what to pass."""
    if moe_tp_size is not None and moe_tp_size != tp_size:
        raise NotImplementedError(
            f"moe_tp_size={moe_tp_size!r} with tp_size={tp_size!r}: meshboost cuts every expert over the model's own "
            f"tensor-parallel group, so the experts' tp size is tp_size; pass moe_tp_size=None (or {tp_size!r}), or "
            "choose tp_size for both")
    if not moe_dp_outside:
        raise NotImplementedError(
            "moe_dp_outside=False (pp as the outermost mesh axis) is not supported: meshboost's mesh with expert "
            "parallelism is (edp, ep, pp, tp), the experts' data-parallel replicas outermost and tp innermost; "
            "drop the argument")
    if enable_sequence_parallelism and sequence_parallelism_mode is None:
        # ColossalAI's MoE plugin picks "all_to_all" here, where HybridParallelPlugin picks "split_gather"
        raise NotImplementedError(
            "enable_sequence_parallelism=True with sequence_parallelism_mode=None: ColossalAI's "
            "MoeHybridParallelPlugin then uses 'all_to_all' (context parallelism), HybridParallelPlugin "
            "'split_gather'; say which: sequence_parallelism_mode='all_to_all' with sp_size > 1 (a sequence axis "
            "of its own, composes with ep), or sequence_parallelism_mode='split_gather' (over the tensor-parallel "
            "group, tp_size > 1), or turn sequence parallelism off")


def moe_colossalai_config(a: dict) -> HybridParallelConfig:
    """ColossalAI's MoeHybridParallelPlugin keywords (`a`, every one of them) as meshboost's config."""
    _refuse_moe(a["tp_size"], a["moe_tp_size"], a["moe_dp_outside"], a["enable_sequence_parallelism"],
                a["sequence_parallelism_mode"])
    shared = {**_HYBRID_DEFAULTS, **{k: v for k, v in a.items() if k not in MOE_KEYWORDS}}
    # replace() validates again, the combinations with ep_size included (ep with fp8, ...)
    return dataclasses.replace(colossalai_config(shared), ep_size=a["ep_size"])


class MoeHybridParallelPlugin(HybridParallelPlugin):
    """meshboost's HybridParallelPlugin with ColossalAI's MoE keywords (`moe_colossalai_config`):

    ep_size (required, as in ColossalAI): the experts of every MoE layer split over ep_size of the
        data-parallel ranks, `HybridParallelConfig.ep_size` (ep must divide dp = world / (tp * pp): the
        mesh refuses otherwise); 1 is plain HybridParallelPlugin with ColossalAI's MoE defaults.
    moe_tp_size: None or tp_size: the experts are cut over the model's tensor-parallel group (any other
        size is refused). moe_dp_outside: True only (meshboost's mesh is (edp, ep, pp, tp)).
    Every other keyword means what it means to this package's HybridParallelPlugin, with ColossalAI's MoE
        defaults where they differ from its HybridParallelPlugin (overlap_communication=False), and this
        package's where it departs from ColossalAI on purpose (precision="fp32", broadcast_buffers=False:
        docs/colossalai.md). check_inputs and loss_normalization (keyword-only) are meshboost's.
    zero_stage=2 and overlap_communication=True are honoured, not turned into stage 1 without overlap as
        ColossalAI does: meshboost's expert-parallel forward gives an expert that received no token a zero
        gradient (never none), so every rank's reducer sees the same buckets and ZeRO-2 cannot hang.
    dp_replicate_size (keyword-only): HSDP with zero_stage=3, as HybridParallelPlugin's; with ep_size > 1 the
        ep ranks sit inside a replica group, so it must divide dp / ep_size (docs/fsdp.md).
    enable_sequence_parallelism=True needs sequence_parallelism_mode="split_gather" spelled out
        or "all_to_all" with sp_size spelled out (ColossalAI's MoE and hybrid plugins default differently).

    ColossalAI's views: `pg_mesh` and `stage_manager` as HybridParallelPlugin's; `ep_size`, `ep_group`
    (None at ep_size 1), `moe_dp_group` (the replicas of this rank's experts) and `moe_dp_size` read the
    mesh.
    """

    def __init__(self, tp_size: int, pp_size: int, ep_size: int, sp_size: int | None = None,
                 precision: str = "fp32", zero_stage: int = 0, enable_all_optimization: bool = False,
                 enable_fused_normalization: bool = False, enable_flash_attention: bool = False,
                 enable_jit_fused: bool = False, enable_sequence_parallelism: bool = False,
                 sequence_parallelism_mode: str | None = None, parallel_output: bool = True,
                 num_microbatches: int | None = None, microbatch_size: int | None = None,
                 initial_scale: float = 2**16, min_scale: float = 1, growth_factor: float = 2,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
                 max_scale: float = 2**32, max_norm: float = 0.0, broadcast_buffers: bool = False,
                 ddp_bucket_cap_mb: int = DDP_BUCKET_CAP_MB, find_unused_parameters: bool = False,
                 check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False, zero_bucket_size_in_m: int = 12,
                 cpu_offload: bool = False, communication_dtype: torch.dtype | None = None,
                 overlap_communication: bool = False, custom_policy: Policy | None = None, pp_style: str = "1f1b",
                 num_model_chunks: int = 1, scheduler_nodes=None, num_layers_per_stage: list[int] | None = None,
                 gradient_checkpoint_config: PipelineGradientCheckpointConfig | None = None,
                 enable_metadata_cache: bool = True, make_vocab_size_divisible_by: int = 64,
                 moe_dp_outside: bool = True, overlap_p2p: bool = True, overlap_allgather: bool = False,
                 fp8_communication: bool = False, use_fp8: bool = False, *, moe_tp_size: int | None = None,
                 check_inputs: str = "always", loss_normalization: str = "tokens", compile=None,
                 moe_router_bias_update_rate: float = 0.0, dp_replicate_size: int = 1):
        keywords = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        # The refusals and the configs' checks below raise per rank: the arguments are agreed first.
        agree_settings(keywords, "MoeHybridParallelPlugin arguments")
        # HybridParallelPlugin's constructor takes its own keywords only: the core's, then the same views
        CorePlugin.__init__(self, moe_colossalai_config(keywords))
        self._colossalai_views()

    @property
    def moe_dp_size(self) -> int:
        """The replicas of one expert: dp_size / ep_size (ColossalAI's name)."""
        return self.mesh.dims.edp
