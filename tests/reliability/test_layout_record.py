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
    planned = plugin_config(Layout(tp=2, pp=2, dp=1, microbatches=2))
    assert (planned.dims, planned.pipeline.num_microbatches) == (config.dims, 2)


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
    layout = Layout(tp=2, dp=1, sequence_parallel=True)
    assert plugin_config(layout).dims == config.dims and layout.sequence_parallel == config.dims.sequence_parallel
    assert plugin_config(Layout(tp=2, dp=1)).dims == ParallelDims(tp=2)
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
