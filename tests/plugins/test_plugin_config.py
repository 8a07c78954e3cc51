"""The typed configs are the one description of a plugin (issue 24): every ColossalAI keyword of
HybridParallelPlugin lands in exactly the field it names (none dropped, none merged), the core's
shortcuts mean what ColossalAI's keywords of the same name mean, each setting is validated once in
its config, and the optimizer wrappers take config objects, not their fields. Pure: no process group."""

import inspect

import pytest
import torch

from meshboost.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin as ColossalAIPlugin
from meshboost.booster.plugin.hybrid_parallel_plugin import colossalai_config
from meshboost.optim import MixedPrecisionOptimizer, ZeroOptimizer
from meshboost.plugins import (
    HybridParallelConfig,
    PipelineConfig,
    PipelineGradientCheckpointConfig,
    PrecisionConfig,
    ShardConfig,
    ZeroConfig,
)
from meshboost.plugins.hybrid_parallel import plugin_config
from meshboost.shardformer import Policy
from meshboost.shardformer.compile import CompileConfig
from meshboost.shardformer.float8 import Float8Config

DEFAULTS = {k: p.default for k, p in inspect.signature(ColossalAIPlugin.__init__).parameters.items()
            if k != "self"}
DEFAULTS["tp_size"] = 1

# keyword -> (another valid value, keywords it needs, the config field path that must change: its own, or
# its own first and the fields its config derives from it)
CHANGES = {
    "tp_size": (2, {}, "dims.tp"),
    "pp_size": (2, {"num_microbatches": 2}, "dims.pp"),      # the record's only (the pipeline keeps its knobs)
    "precision": ("bf16", {}, "precision.precision"),
    "zero_stage": (1, {}, "zero.stage"),
    "parallel_output": (False, {}, "sharding.parallel_output"),
    "make_vocab_size_divisible_by": (128, {}, "sharding.make_vocab_size_divisible_by"),
    "custom_policy": (Policy(name="custom", plan={"*.q": "colwise"}), {}, "custom_policy"),
    "enable_tensor_parallelism": (False, {}, "sharding.enable_tensor_parallelism"),
    # the layout record's tp mode (the plugin's ShardConfig reads it through the mesh, its mode "split_gather")
    "enable_sequence_parallelism": (True, {}, "dims.sequence_parallel"),
    "max_norm": (1.0, {}, "precision.max_norm"),
    "num_microbatches": (4, {"pp_size": 2, "num_microbatches": 2}, "pipeline.num_microbatches"),
    "microbatch_size": (1, {"pp_size": 2, "microbatch_size": 2}, "pipeline.microbatch_size"),
    "num_layers_per_stage": ([1, 1], {"pp_size": 2, "num_microbatches": 2}, "pipeline.num_layers_per_stage"),
    "find_unused_parameters": (True, {}, "ddp.find_unused_parameters"),
    "ddp_bucket_cap_mb": (50, {}, "ddp.bucket_cap_mb"),
    "broadcast_buffers": (True, {}, "ddp.broadcast_buffers"),
    "initial_scale": (2.0**10, {}, "precision.scaler.initial_scale"),
    "min_scale": (2.0, {}, "precision.scaler.min_scale"),
    "growth_factor": (3.0, {}, "precision.scaler.growth_factor"),
    "backoff_factor": (0.25, {}, "precision.scaler.backoff_factor"),
    "growth_interval": (10, {}, "precision.scaler.growth_interval"),
    "hysteresis": (1, {}, "precision.scaler.hysteresis"),
    "max_scale": (2.0**20, {}, "precision.scaler.max_scale"),
    "max_skips_at_min_scale": (5, {}, "precision.scaler.max_skips_at_min_scale"),
    "overlap_communication": (False, {}, "zero.overlap_communication"),
    "zero_bucket_size_in_m": (1, {}, "zero.reduce_bucket_size"),
    "check_inputs": ("first", {}, "check_inputs"),
    "loss_normalization": ("microbatch", {}, "loss_normalization"),
    "moe_router_bias_update_rate": (1e-3, {}, "moe_router_bias_update_rate"),
    "dp_replicate_size": (2, {"zero_stage": 3}, "dims.dp_replicate"),
    "enable_flash_attention": (True, {}, "sharding.enable_flash_attention"),
    "enable_fused_normalization": (True, {}, "sharding.enable_fused_normalization"),
    "enable_jit_fused": (True, {}, "sharding.enable_jit_fused"),
    "enable_sequence_overlap": (True, {"enable_sequence_parallelism": True}, "sharding.enable_sequence_overlap"),
    "enable_all_optimization": (True, {}, ("sharding.enable_all_optimization", "sharding.enable_flash_attention",
                                           "sharding.enable_fused_normalization", "sharding.enable_jit_fused")),
    "sequence_parallelism_mode": ("split_gather", {}, "sharding.sequence_parallelism_mode"),
    "gradient_checkpoint_config": (PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=0.5), {},
                                   "gradient_checkpoint"),
    "check_reduction": (True, {}, "ddp.check_reduction"),
    "gradient_as_bucket_view": (True, {}, "ddp.gradient_as_bucket_view"),
    "static_graph": (True, {}, "ddp.static_graph"),
    "cpu_offload": (True, {"zero_stage": 1}, "zero.cpu_offload"),
    "communication_dtype": (torch.bfloat16, {"zero_stage": 1}, "zero.communication_dtype"),
    "fp8_communication": (True, {}, "fp8_communication"),
    "use_fp8": (Float8Config(recipe="rowwise"), {}, "float8"),
    "compile": (CompileConfig(backend="aot_eager"), {}, "compile"),
}
# keywords valid only together: changed together, each into its own field
JOINT = {("pp_style", "num_model_chunks"): (("interleaved", 2), {"pp_size": 2, "num_microbatches": 2},
                                            ("pipeline.pp_style", "pipeline.num_model_chunks"))}
# accepted with either value (no effect), or refused: test_plugin_attributes.py checks both
NO_FIELD = {"enable_metadata_cache", "overlap_p2p", "sp_size", "scheduler_nodes", "dp_outside", "overlap_allgather",
            "inner_ring_size"}


def _field(config, path):
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _leaves(config, prefix=""):
    """Every field of the config tree, as path -> value."""
    out = {}
    for name in getattr(config, "__dataclass_fields__", {}):
        value = getattr(config, name)
        if hasattr(value, "__dataclass_fields__") and not isinstance(value, (Policy, PipelineGradientCheckpointConfig, Float8Config,
                                                                               CompileConfig)):
            out.update(_leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def test_every_colossalai_keyword_lands_in_its_own_field():
    joint = {k for keys in JOINT for k in keys}
    assert set(CHANGES) | joint | NO_FIELD == set(DEFAULTS), "a ColossalAI keyword is neither mapped nor no-field"
    for keys, (values, needs, paths) in JOINT.items():
        base = colossalai_config({**DEFAULTS, **needs})
        changed = colossalai_config({**DEFAULTS, **needs, **dict(zip(keys, values))})
        assert {k for k, v in _leaves(changed).items() if _leaves(base)[k] != v} == set(paths)
        assert [_field(changed, path) for path in paths] == list(values)
    for keyword, (value, needs, path) in CHANGES.items():
        base = colossalai_config({**DEFAULTS, **needs})
        changed = colossalai_config({**DEFAULTS, **needs, keyword: value})
        paths = (path,) if isinstance(path, str) else path
        moved = {k for k, v in _leaves(changed).items() if _leaves(base)[k] != v}
        assert moved == set(paths), f"{keyword}={value!r} changed {sorted(moved)}, expected {paths}"
        expected = int(value * 1024 * 1024) if keyword == "zero_bucket_size_in_m" else value
        assert _field(changed, paths[0]) == expected, keyword


def test_the_shortcuts_mean_the_colossalai_keywords():
    """`meshboost.plugins.HybridParallelPlugin(tp_size=, pp_size=, zero_stage=, precision=)` builds the config
    ColossalAI's keywords of those names build, every other setting at its default."""
    for shortcuts in ({}, {"tp_size": 2}, {"zero_stage": 3, "precision": "bf16"}, {"tp_size": 4, "zero_stage": 1}):
        assert plugin_config(None, shortcuts, {}) == colossalai_config({**DEFAULTS, **shortcuts})
    assert HybridParallelConfig() == colossalai_config(DEFAULTS)


def test_core_plugin_arguments_are_refused_with_the_fix():
    with pytest.raises(TypeError, match="num_microbatches.*meshboost.booster.plugin"):
        plugin_config(None, {"tp_size": 2}, {"num_microbatches": 4})
    with pytest.raises(TypeError, match="tp_size=2"):
        plugin_config(2, {}, {})
    with pytest.raises(ValueError, match=r"pp_size=2\) needs a micro-batch setting.*HybridParallelConfig\(pp_size=2, "
                                         r"pipeline=PipelineConfig\(num_microbatches=\.\.\.\)\)"):
        plugin_config(None, {"tp_size": 1, "pp_size": 2}, {})
    with pytest.raises(ValueError, match="inside the config"):
        plugin_config(HybridParallelConfig(), {"tp_size": 2}, {})
    with pytest.raises(TypeError, match="pass a PipelineConfig"):
        HybridParallelConfig(pipeline={"pp_size": 2})


def test_each_setting_is_validated_once_in_its_config():
    with pytest.raises(ValueError, match=r"zero_stage=4; expected one of \(0, 1, 2, 3\)"):
        ZeroConfig(stage=4)
    for stage in (0, 3):
        with pytest.raises(ValueError, match="cpu_offload=True.*set zero_stage=1 or 2"):
            ZeroConfig(stage=stage, cpu_offload=True)
    HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2), zero=ZeroConfig(3))   # test_zero3_axes.py
    with pytest.raises(ValueError, match="reshard_after_forward=False is FSDP2's setting, but zero_stage=1"):
        HybridParallelConfig(zero=ZeroConfig(1), reshard_after_forward=False)
    with pytest.raises(ValueError, match="communication_dtype=torch.bfloat16.*zero_stage=0"):
        HybridParallelConfig(zero=ZeroConfig(communication_dtype=torch.bfloat16))
    HybridParallelConfig(precision=PrecisionConfig("bf16"), zero=ZeroConfig(communication_dtype=torch.bfloat16))
    with pytest.raises(NotImplementedError, match=r"fp8_communication=True with \(tp_size, pp_size, zero_stage\)"):
        HybridParallelConfig(tp_size=2, fp8_communication=True)
    with pytest.raises(ValueError, match="tp_size=2 with enable_tensor_parallelism=False"):
        HybridParallelConfig(tp_size=2, sharding=ShardConfig(enable_tensor_parallelism=False))
    with pytest.raises(ValueError, match="zero_bucket_size_in_m=0"):
        colossalai_config({**DEFAULTS, "zero_bucket_size_in_m": 0})


def test_optimizer_wrappers_take_config_objects():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match=r"PrecisionConfig\('fp16'\)"):
        MixedPrecisionOptimizer(torch.optim.SGD(params, lr=0.1), None, "fp16")
    with pytest.raises(TypeError, match="ZeroConfig"):
        ZeroOptimizer(torch.optim.SGD(params, lr=0.1), None, PrecisionConfig(), 1)
    with pytest.raises(ValueError, match="stage 3 is torch FSDP2's"):
        ZeroOptimizer(torch.optim.SGD(params, lr=0.1), None, PrecisionConfig(), ZeroConfig(3))


def test_the_layout_is_one_parallel_dims():
    """HybridParallelConfig's degrees and cp's mode live in one ParallelDims (`config.dims`): the keywords build
    it (pp included), dataclasses.replace keeps it, and dims.py refuses bad values."""
    import dataclasses

    from meshboost.distributed.dims import ParallelDims
    from meshboost.pipeline import PipelineConfig

    config = HybridParallelConfig(tp_size=2, cp_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2))
    assert config.dims == ParallelDims(dp=None, pp=2, tp=2, cp=2, cp_mode="all_to_all")      # the default mode
    assert config.dims.pp == 2
    moved = dataclasses.replace(config, ep_size=2, zero=ZeroConfig(stage=1))       # the other degrees stay
    assert moved.dims == dataclasses.replace(config.dims, ep=2) and moved.zero.stage == 1
    assert dataclasses.replace(moved, cp_size=1).dims.cp_mode is None               # cp off: no mode left
    whole = HybridParallelConfig(dims=ParallelDims(tp=2, cp=2, cp_mode="ring_attn"))
    assert (whole.dims.tp, whole.dims.cp, whole.dims.cp_mode, whole.dims.pp) == (2, 2, "ring_attn", 1)
    assert HybridParallelConfig(dims=ParallelDims(tp=2), tp_size=4).dims.tp == 4    # a keyword overrides dims
    with pytest.raises(ValueError, match=r"pp_size=2 needs num_microbatches .*PipelineConfig\(num_microbatches="):
        HybridParallelConfig(dims=ParallelDims(pp=2))
    with pytest.raises(ValueError, match="cp_size=0 must be a positive integer"):
        HybridParallelConfig(cp_size=0)
    with pytest.raises(ValueError, match="cp_mode='ring_attn' with cp_size=1 splits nothing"):
        HybridParallelConfig(cp_mode="ring_attn")
    with pytest.raises(TypeError, match="pass a meshboost.distributed.ParallelDims"):
        HybridParallelConfig(dims=(2, 2))
    # the world resolves dp, once, in dims.py; an unresolved record says so instead of a wrong size
    assert ParallelDims(tp=2, cp=2).resolved(8) == ParallelDims(dp=2, tp=2, cp=2)
    with pytest.raises(ValueError, match="not resolved against a world"):
        ParallelDims(tp=2).size("dp")
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by tp_size x pp_size x cp_size = 1 x 1 x 4"):
        ParallelDims(cp=4).resolved(6)
