"""ColossalAI's MoeHybridParallelPlugin keywords land in meshboost's config as HybridParallelPlugin's do:
its signature is ColossalAI's (names, order, the three required sizes), `ep_size` lands in
`HybridParallelConfig.dims.ep` and nowhere else, every keyword it shares with HybridParallelPlugin moves
only its own field (test_plugin_config.py's table, run through the MoE mapping), and the MoE keywords
meshboost does not implement are refused naming the keyword and the fix, before any collective. Pure
(no process group) but for one 2-process construction that reads ColossalAI's attributes off the mesh."""

import inspect

import pytest
import torch.distributed as dist
from test_plugin_config import CHANGES, JOINT, NO_FIELD, _field, _leaves

import meshboost.plugins
from meshboost.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin as ColossalAIPlugin
from meshboost.booster.plugin.hybrid_parallel_plugin import colossalai_config
from meshboost.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin, moe_colossalai_config
from meshboost.testing import spawn

# ColossalAI's MoeHybridParallelPlugin.__init__ (booster/plugin/moe_hybrid_parallel_plugin.py, 2026-04), in order
COLOSSALAI_MOE_KEYWORDS = """tp_size pp_size ep_size sp_size precision zero_stage enable_all_optimization
    enable_fused_normalization enable_flash_attention enable_jit_fused enable_sequence_parallelism
    sequence_parallelism_mode parallel_output num_microbatches microbatch_size initial_scale min_scale growth_factor
    backoff_factor growth_interval hysteresis max_scale max_norm broadcast_buffers ddp_bucket_cap_mb
    find_unused_parameters check_reduction gradient_as_bucket_view static_graph zero_bucket_size_in_m cpu_offload
    communication_dtype overlap_communication custom_policy pp_style num_model_chunks scheduler_nodes
    num_layers_per_stage gradient_checkpoint_config enable_metadata_cache make_vocab_size_divisible_by moe_dp_outside
    overlap_p2p overlap_allgather fp8_communication use_fp8""".split()
# keyword-only: moe_tp_size (ColossalAI's MoE tests pass it), and meshboost's own settings
EXTRA_KEYWORDS = ["moe_tp_size", "check_inputs", "loss_normalization", "compile", "moe_router_bias_update_rate",
                  "dp_replicate_size"]

PARAMETERS = {k: p for k, p in inspect.signature(MoeHybridParallelPlugin.__init__).parameters.items() if k != "self"}
DEFAULTS = {k: p.default for k, p in PARAMETERS.items()} | {"tp_size": 1, "pp_size": 1, "ep_size": 1}
HYBRID_DEFAULTS = {k: p.default for k, p in inspect.signature(ColossalAIPlugin.__init__).parameters.items()
                   if k != "self"} | {"tp_size": 1}

# test_plugin_config's changes, through the MoE mapping; where the MoE plugin differs: overlap_communication
# defaults to False (so it moves to True), and sequence parallelism needs its mode spelled out
MOE_CHANGES = {k: v for k, v in CHANGES.items() if k in PARAMETERS} | {
    "overlap_communication": (True, {}, "zero.overlap_communication"),
    "enable_sequence_parallelism": (True, {"sequence_parallelism_mode": "split_gather"},
                                    "dims.sequence_parallel"),
    "ep_size": (2, {}, "dims.ep"),
}
# accepted with the value that means meshboost's layout: no field of their own
MOE_NO_FIELD = {"moe_tp_size", "moe_dp_outside"}


def test_the_signature_is_colossalais():
    positional = [k for k, p in PARAMETERS.items() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional == COLOSSALAI_MOE_KEYWORDS
    assert [k for k, p in PARAMETERS.items() if p.kind is p.KEYWORD_ONLY] == EXTRA_KEYWORDS
    assert [k for k, p in PARAMETERS.items() if p.default is p.empty] == ["tp_size", "pp_size", "ep_size"]
    # the defaults of the shared keywords are HybridParallelPlugin's, but ColossalAI's MoE overlap default
    shared = {k for k in PARAMETERS if k in HYBRID_DEFAULTS} - {"tp_size", "pp_size"}
    assert {k for k in shared if DEFAULTS[k] != HYBRID_DEFAULTS[k]} == {"overlap_communication"}
    assert DEFAULTS["overlap_communication"] is False
    assert moe_colossalai_config(DEFAULTS) == colossalai_config({**HYBRID_DEFAULTS, "overlap_communication": False})


def test_every_moe_keyword_lands_in_its_own_field():
    joint = {k for keys in JOINT for k in keys}
    assert set(MOE_CHANGES) | joint | (NO_FIELD & set(PARAMETERS)) | MOE_NO_FIELD == set(PARAMETERS), \
        "a MoeHybridParallelPlugin keyword is neither mapped nor no-field"
    for keys, (values, needs, paths) in JOINT.items():
        base = _leaves(moe_colossalai_config({**DEFAULTS, **needs}))
        changed = moe_colossalai_config({**DEFAULTS, **needs, **dict(zip(keys, values))})
        assert {k for k, v in _leaves(changed).items() if base[k] != v} == set(paths)
    for keyword, (value, needs, path) in MOE_CHANGES.items():
        base = _leaves(moe_colossalai_config({**DEFAULTS, **needs}))
        changed = moe_colossalai_config({**DEFAULTS, **needs, keyword: value})
        paths = (path,) if isinstance(path, str) else path
        moved = {k for k, v in _leaves(changed).items() if base[k] != v}
        assert moved == set(paths), f"{keyword}={value!r} changed {sorted(moved)}, expected {paths}"
        expected = int(value * 1024 * 1024) if keyword == "zero_bucket_size_in_m" else value
        assert _field(changed, paths[0]) == expected, keyword
    # the experts' tp is the model's: moe_tp_size None or tp_size, the same config
    for tp in (1, 2):
        same = moe_colossalai_config({**DEFAULTS, "tp_size": tp, "ep_size": 2})
        assert moe_colossalai_config({**DEFAULTS, "tp_size": tp, "ep_size": 2, "moe_tp_size": tp}) == same
    for keyword, value in (("enable_metadata_cache", False), ("overlap_p2p", False), ("sp_size", 1),
                           ("moe_dp_outside", True)):
        assert moe_colossalai_config({**DEFAULTS, keyword: value}) == moe_colossalai_config(DEFAULTS), keyword


def test_zero2_and_overlap_are_honoured_with_experts():
    """ColossalAI turns them into ZeRO-1 without overlap (its hang when an expert gets no token); meshboost's
    expert-parallel forward gives such experts zero gradients, so they are kept as given."""
    config = moe_colossalai_config({**DEFAULTS, "ep_size": 2, "zero_stage": 2, "overlap_communication": True,
                                    "precision": "bf16"})
    assert (config.dims.ep, config.zero.stage, config.zero.overlap_communication) == (2, 2, True)


def test_refusals_name_the_keyword_and_the_fix():
    refused = [
        ({"tp_size": 2, "moe_tp_size": 1}, NotImplementedError, r"moe_tp_size=1 with tp_size=2.*moe_tp_size=None"),
        ({"moe_tp_size": 2}, NotImplementedError, r"moe_tp_size=2 with tp_size=1"),
        ({"moe_dp_outside": False}, NotImplementedError, r"moe_dp_outside=False.*drop the argument"),
        ({"enable_sequence_parallelism": True}, NotImplementedError,
         r"sequence_parallelism_mode=None.*'all_to_all'.*sequence_parallelism_mode='split_gather'"),
        ({"ep_size": 0}, ValueError, r"ep_size=0 must be a positive integer"),
        ({"ep_size": True}, ValueError, r"ep_size=True must be a positive integer"),
        ({"ep_size": 2.0}, ValueError, r"ep_size=2.0 must be a positive integer"),
        ({"sp_size": 2}, ValueError, r"sp_size=2 with enable_sequence_parallelism=False"),
        ({"sp_size": 2, "enable_sequence_parallelism": True, "sequence_parallelism_mode": "split_gather"}, ValueError,
         r"sp_size=2 with sequence_parallelism_mode='split_gather' and tp_size=1"),
        ({"use_fp8": True, "tp_size": 2, "sp_size": 2, "enable_sequence_parallelism": True,
          "sequence_parallelism_mode": "all_to_all"}, NotImplementedError, r"float8 with tp_size=2 and cp_size=2"),
        ({"overlap_allgather": True}, NotImplementedError, r"overlap_allgather=True"),
        ({"scheduler_nodes": []}, NotImplementedError, r"scheduler_nodes="),
    ]
    for change, error, message in refused:
        with pytest.raises(error, match=message):
            moe_colossalai_config({**DEFAULTS, **change})
    # the constructor raises them before any collective: here there is no process group at all
    assert not dist.is_initialized()
    for change, error, message in refused[:3] + refused[5:7]:
        with pytest.raises(error, match=message):
            MoeHybridParallelPlugin(**{**DEFAULTS, **change})
    assert not dist.is_initialized()


def test_import_paths():
    from meshboost.booster.plugin import HybridParallelPlugin
    from meshboost.booster.plugin import MoeHybridParallelPlugin as Served
    from meshboost.booster.plugin.moe_hybrid_parallel_plugin import HybridParallelPlugin as Reexported

    assert Served is MoeHybridParallelPlugin
    assert Reexported is HybridParallelPlugin is ColossalAIPlugin
    assert issubclass(MoeHybridParallelPlugin, ColossalAIPlugin)
    assert issubclass(MoeHybridParallelPlugin, meshboost.plugins.HybridParallelPlugin)
    # no behaviour of its own: its constructor and ColossalAI's moe_dp_size
    assert {k for k in vars(MoeHybridParallelPlugin) if not k.startswith("_")} == {"moe_dp_size"}


def _attributes_body(rank, world_size):
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=1, precision="bf16")
    assert plugin.config.dims.ep == plugin.ep_size == 2
    assert (plugin.dp_size, plugin.moe_dp_size, plugin.tp_size, plugin.pp_size) == (2, 1, 1, 1)
    assert dist.get_world_size(plugin.ep_group) == 2
    assert dist.get_world_size(plugin.moe_dp_group) == 1
    assert plugin.stage_manager is None and plugin.pg_mesh.mesh is plugin.mesh
    assert (plugin.zero_stage, plugin.precision) == (1, "bf16")


def test_colossalai_attributes_read_the_mesh():
    spawn(_attributes_body, 2)
