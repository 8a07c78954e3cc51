"""The layout's degrees live in one record, `ParallelDims` (issue 57, item 2): the configs hold the record, not
its ingredients. pp is the record's only: `PipelineConfig` keeps the micro-batch and schedule knobs,
`dataclasses.replace(config, pipeline=...)` keeps the degree, and every door (meshboost's keywords,
ColossalAI's, the planner's layout) builds the same record; a bad value or a knob that needs another pp
gives one error naming the value and the fix. Pure: no process group."""

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
