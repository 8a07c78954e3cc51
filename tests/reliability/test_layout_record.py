"""The layout's degrees live in one record, `ParallelDims` (issue 57, item 2): the configs hold the record, not
its ingredients. pp is the record's only: `PipelineConfig` keeps the micro-batch and schedule knobs,
`dataclasses.replace(config, pipeline=...)` keeps the degree, and every door (meshboost's keywords,
ColossalAI's, the planner's layout) builds the same record; a bad value or a knob that needs another pp
gives one error naming the value and the fix. Megatron sequence parallelism is the record's tp mode
(`ParallelDims.sequence_parallel`): ColossalAI's keywords, meshboost's and the planner's layout build it, the
plugin's ShardConfig reads it through the mesh, and the config's ShardConfig keeps knobs only. No processes:
the plugin is built on rank 0 of torch's fake process group."""

import dataclasses
import inspect

import pytest

from meshboost.booster.plugin.hybrid_parallel_plugin import HybridParallelPlugin as ColossalAIPlugin
from meshboost.booster.plugin.hybrid_parallel_plugin import colossalai_config
from meshboost.distributed.dims import ParallelDims
from meshboost.plan.layout import Layout, plugin_config
from meshboost.plugins import HybridParallelConfig, PipelineConfig, ZeroConfig

DEFAULTS = {k: p.default for k, p in inspect.signature(ColossalAIPlugin.__init__).parameters.items() if k != "self"}
DEFAULTS["tp_size"] = 1


def test_pp_lives_only_in_the_record():
    assert "pp_size" not in {f.name for f in dataclasses.fields(PipelineConfig)}
    config = HybridParallelConfig(tp_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2))
    assert config.dims == ParallelDims(pp=2, tp=2)
    # another pipeline config keeps the degree (it raised "pass dims with pp=1 or pp=1" on main)
    moved = dataclasses.replace(config, pipeline=PipelineConfig(num_microbatches=4))
    assert (moved.dims, moved.pipeline.num_microbatches) == (config.dims, 4)
    interleaved = dataclasses.replace(config, pipeline=PipelineConfig("interleaved", 2, num_microbatches=4))
    assert interleaved.dims.pp == 2 and interleaved.pipeline.num_stages(interleaved.dims.pp) == 4
    assert dataclasses.replace(config, zero=ZeroConfig(stage=1)).dims.pp == 2
    # the record given whole, and the keyword over it
    assert HybridParallelConfig(dims=ParallelDims(pp=2), pipeline=PipelineConfig(num_microbatches=2)).dims.pp == 2
    assert dataclasses.replace(config, pp_size=1, pipeline=PipelineConfig()).dims == ParallelDims(tp=2)
    # every door builds the same record: meshboost's keywords, ColossalAI's, the planner's layout
    colossalai = colossalai_config({**DEFAULTS, "tp_size": 2, "pp_size": 2, "num_microbatches": 2})
    assert colossalai == config
    planned = plugin_config(Layout.of(tp=2, pp=2, dp=1, microbatches=2))     # planned for a world: dp given
    assert (planned.dims, planned.pipeline.num_microbatches) == (dataclasses.replace(config.dims, dp=1), 2)


def test_pp_errors_name_the_value_and_the_fix():
    config = HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2))
    with pytest.raises(ValueError, match=r"pp_size=2 needs num_microbatches or microbatch_size \(got neither\), "
                                         r"e\.g\. PipelineConfig\(num_microbatches=4\)"):
        dataclasses.replace(config, pipeline=PipelineConfig())
    with pytest.raises(ValueError, match=r"num_layers_per_stage=\[1, 1, 1\] needs 2 entries \(pp_size x "
                                         r"num_model_chunks = 2 x 1\)"):
        HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2, num_layers_per_stage=[1, 1, 1]))
    with pytest.raises(ValueError, match="only apply with pp_size > 1"):
        HybridParallelConfig(pipeline=PipelineConfig("interleaved", 2))       # at pp 1
    with pytest.raises(ValueError, match="pp_size=0 must be a positive integer"):
        HybridParallelConfig(pp_size=0)
    # the degree given to the pipeline's config: refused, naming where it goes
    with pytest.raises(TypeError, match=r"PipelineConfig\(pp_size=2\).*HybridParallelConfig\(pp_size=2, "
                                        r"pipeline=PipelineConfig\(num_microbatches=\.\.\.\)\)"):
        PipelineConfig(pp_size=2, num_microbatches=2)
    with pytest.raises(ValueError, match=r"pp_style=2.*HybridParallelConfig\(pp_size=\.\.\.\), no longer "
                                         "PipelineConfig's first argument"):
        PipelineConfig(2, num_microbatches=2)


def _on_fake_rank(build, world: int = 2):
    """`build()` on rank 0 of a `world`-rank fake process group (no processes, no collectives)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return build()
    finally:
        dist.destroy_process_group()


def test_sequence_parallelism_is_the_records_tp_mode():
    from meshboost.plugins import HybridParallelPlugin

    config = HybridParallelConfig(tp_size=2, sequence_parallel=True)
    assert config.dims == ParallelDims(tp=2, sequence_parallel=True)
    assert config.sharding.enable_sequence_parallelism is None          # the sharding config holds knobs only
    for mode in ("split_gather", "ring", None):     # ColossalAI's keywords build the same record
        colossalai = colossalai_config({**DEFAULTS, "tp_size": 2, "enable_sequence_parallelism": True,
                                        "sequence_parallelism_mode": mode})
        assert colossalai.dims == config.dims and colossalai.sharding.enable_sequence_parallelism is None, mode
    # the planner's layout names the same field, and its config carries it in the record
    layout = Layout.of(tp=2, dp=1, sequence_parallel=True)
    assert plugin_config(layout).dims == dataclasses.replace(config.dims, dp=1) == layout.dims
    assert plugin_config(Layout.of(tp=2, dp=1)).dims == ParallelDims(dp=1, tp=2)
    # another part replaced keeps the mode; the keyword turns it off
    assert dataclasses.replace(config, zero=ZeroConfig(stage=1), pp_size=2,
                               pipeline=PipelineConfig(num_microbatches=2)).dims.sequence_parallel
    from meshboost.shardformer import ShardConfig
    assert dataclasses.replace(config, sharding=ShardConfig(enable_flash_attention=True)).dims.sequence_parallel
    assert not dataclasses.replace(config, sequence_parallel=False).dims.sequence_parallel
    # the plugin's shard config reads the record through its mesh: what the sharder and policies see
    for given, expected in ((config, (True, "split_gather", 2)), (HybridParallelConfig(tp_size=2), (False, None, 1))):
        plugin = _on_fake_rank(lambda: HybridParallelPlugin(given))
        shard = plugin.shard_config
        assert plugin.mesh.dims.sequence_parallel is expected[0]
        assert (shard.enable_sequence_parallelism, shard.sequence_parallelism_mode,
                shard.sequence_parallel_size) == expected


def test_sequence_parallel_errors_name_the_value_and_the_fix():
    from meshboost.distributed.mesh import ParallelMesh
    from meshboost.shardformer import ShardConfig

    with pytest.raises(ValueError, match=r"ShardConfig\(enable_sequence_parallelism=True\)\): Megatron sequence "
                                         r"parallelism is a mode of the layout record's tp axis.*"
                                         r"HybridParallelConfig\(sequence_parallel=True, \.\.\.\)"):
        HybridParallelConfig(tp_size=2, sharding=ShardConfig(enable_sequence_parallelism=True))
    with pytest.raises(ValueError, match=r"cp_size=2 with sequence_parallel=True .*turn one off"):
        HybridParallelConfig(cp_size=2, sequence_parallel=True)
    with pytest.raises(TypeError, match="sequence_parallel='yes': pass True"):
        ParallelDims(tp=2, sequence_parallel="yes")
    with pytest.raises(ValueError, match=r"enable_sequence_overlap=True needs enable_sequence_parallelism=True "
                                         r"\(meshboost's HybridParallelConfig\(sequence_parallel=True\)\)"):
        HybridParallelConfig(tp_size=2, sharding=ShardConfig(enable_sequence_overlap=True))
    with pytest.raises(ValueError, match="sequence_parallelism_mode='bogus' is unknown"):
        HybridParallelConfig(tp_size=2, sequence_parallel=True, sharding=ShardConfig(sequence_parallelism_mode="bogus"))
    # a shard config built on a mesh cannot say otherwise than the mesh's record
    with pytest.raises(ValueError, match=r"ShardConfig\(enable_sequence_parallelism=True\) with a mesh whose layout "
                                         r"record has sequence_parallel=False.*ParallelDims\(\.\.\., "
                                         r"sequence_parallel=True\)"):
        _on_fake_rank(lambda: ShardConfig(mesh=ParallelMesh(ParallelDims(tp=2), device_type="cpu"),
                                          enable_sequence_parallelism=True))


def test_the_planners_layout_holds_the_record():
    """`plan.Layout` holds one `ParallelDims` and no degree of its own (its tp, dp, ... read the record), the
    keyword door `Layout.of` builds that record first, and the plugin config the planner builds carries it
    whole: dp and the tp mode (Megatron sequence parallelism) included, no field mapped back to a keyword."""
    degrees = {"tp", "pp", "dp", "ep", "cp", "cp_mode", "sequence_parallel", "dp_replicate"}
    assert {f.name for f in dataclasses.fields(Layout)} & degrees == set()
    record = ParallelDims(dp=2, tp=2, sequence_parallel=True)
    layout = Layout(record, zero=1, microbatch_size=2)
    assert layout.dims is record and (layout.tp, layout.dp, layout.sequence_parallel) == (2, 2, True)
    assert Layout.of(tp=2, dp=2, sequence_parallel=True, zero=1, microbatch_size=2) == layout
    assert plugin_config(layout).dims == record         # dp=2 too: the mesh checks it against the world it runs on
    for given in (Layout.of(cp=2, dp=2), Layout.of(cp=2, cp_mode="ring_attn", pp=2, microbatches=2),
                  Layout.of(dp=4, ep=2, zero=1), Layout(ParallelDims(dp=4, dp_replicate=2), zero=3)):
        assert plugin_config(given).dims == given.dims, given.describe()
    # cp's mode defaults in the record itself (the plugin's default), never beside it
    assert Layout.of(cp=2).dims == ParallelDims(dp=1, cp=2, cp_mode="all_to_all")
    # another degree: a new record, the knobs kept
    hsdp = dataclasses.replace(layout, dims=dataclasses.replace(record, sequence_parallel=False, dp_replicate=2))
    assert (hsdp.dims.dp_replicate, hsdp.sequence_parallel, hsdp.zero, hsdp.microbatch_size) == (2, False, 1, 2)
    # one door: the degrees beside the record are refused, and a record planned for no world
    with pytest.raises(TypeError, match="tp"):
        Layout(tp=2)
    with pytest.raises(ValueError, match=r"a layout is planned for one world; give its dp"):
        Layout(ParallelDims(tp=2))
    with pytest.raises(TypeError, match=r"pass a meshboost.distributed.ParallelDims, or the degrees as keywords, "
                                        r"Layout.of\(tp=\.\.\., dp=\.\.\., \.\.\.\)"):
        Layout({"tp": 2})


def test_the_mesh_repr_names_every_axis_and_its_mode():
    """`ParallelMesh`'s repr shows the record: every axis beyond one rank, cp's mode and tp's (`tp=2(sp)`)."""
    from meshboost.distributed.mesh import ParallelMesh

    cases = {ParallelDims(): "ParallelMesh(dp=8, pp=1, tp=1; rank 0 at dp=0, pp=0, tp=0; cpu)",
             ParallelDims(tp=2, sequence_parallel=True): "ParallelMesh(dp=4, pp=1, tp=2(sp); rank 0 at dp=0, pp=0, "
                                                         "tp=0; cpu)",
             ParallelDims(tp=2, ep=2, dp_replicate=2): "ParallelMesh(dp=4, ep=2, dp_replicate=2, pp=1, tp=2; rank 0 "
                                                       "at dp=0, pp=0, tp=0; cpu)",
             ParallelDims(pp=2, cp=2, cp_mode="ring_attn"): "ParallelMesh(dp=2, pp=2, cp=2(ring_attn), tp=1; rank 0 "
                                                            "at dp=0, pp=0, cp=0, tp=0; cpu)"}
    for dims, expected in cases.items():
        assert repr(_on_fake_rank(lambda: ParallelMesh(dims, device_type="cpu"), world=8)) == expected, dims
