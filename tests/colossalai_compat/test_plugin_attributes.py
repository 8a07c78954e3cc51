"""What ColossalAI scripts read off HybridParallelPlugin, on 2 processes: `stage_manager` at pp=2
(interleaved, 2 chunks: stage, num_stages, first/last stage with and without a chunk), `pg_mesh`
(ranks of a group in stage order, shape, axes), the dp/pp/tp groups and sizes, `stage_manager` None
and the tp group at tp=2; `booster.execute_pipeline(..., return_outputs=True)` returning the
unsharded model's `outputs["outputs"]["logits"]` on the last stage; ColossalAI's DDP keywords
honoured; every ColossalAI keyword meshboost does not implement refused with its message on every
rank (TorchDDPPlugin's fp8_communication too), and prepare_dataloader's distributed_sampler_cls
(built over the dp ranks)."""

import copy

import pytest
import torch
import torch.distributed as dist

from meshboost.booster import Booster
from meshboost.booster.plugin import HybridParallelPlugin, TorchDDPPlugin
from meshboost.cluster import PipelineStageManager, ProcessGroupMesh
from meshboost.nn.optimizer import HybridAdam
from meshboost.testing import spawn
from meshboost.testing.models import build_model, tiny_batch, tiny_config

REFUSED = [
    (dict(cpu_offload=True), "cpu_offload=True moves ZeRO's .* zero_stage=0; set zero_stage=1 or 2"),
    (dict(communication_dtype=torch.float16), "communication_dtype=torch.float16 sets the dtype of ZeRO"),
    (dict(scheduler_nodes=[]), "zero-bubble"),
    (dict(dp_outside=False), "dp_outside=False"),
    (dict(overlap_allgather=True), "overlap_allgather=True"),
    (dict(fp8_communication=True), "fp8_communication=True\\) compresses .* on CUDA; this process computes on 'cpu'"),
    (dict(inner_ring_size=2), "double ring"),
    (dict(sp_size=2), "sp_size=2"),
]


def _pipeline_attributes(rank, world):
    plugin = HybridParallelPlugin(tp_size=1, pp_size=world, pp_style="interleaved", num_model_chunks=2,
                                  microbatch_size=2, num_microbatches=None, precision="fp32")
    sm = plugin.stage_manager
    assert isinstance(sm, PipelineStageManager) and isinstance(plugin.pg_mesh, ProcessGroupMesh)
    assert (sm.num_stages, sm.stage, sm.num_model_chunks, sm.is_interleave) == (world, rank, 2, True)
    assert sm.is_first_stage(ignore_chunk=True) == (rank == 0)
    assert sm.is_last_stage(ignore_chunk=True) == (rank == world - 1)
    with sm.switch_model_chunk_id(0):
        assert not sm.is_last_stage() and sm.is_first_stage() == (rank == 0)
    with sm.switch_model_chunk_id(1):
        assert sm.is_last_stage() == (rank == world - 1) and not sm.is_first_stage()
    assert sm.get_stage_index([1, 1, 1, 1]) == [[rank, rank + 1], [world + rank, world + rank + 1]]
    assert plugin.pg_mesh.get_ranks_in_group(plugin.pp_group) == list(range(world))      # stage order
    assert plugin.pg_mesh.shape == (1, world, 1) and plugin.pg_mesh.coordinate(plugin.pp_axis) == rank
    assert (plugin.dp_size, plugin.pp_size, plugin.tp_size) == (1, world, 1)
    assert dist.get_process_group_ranks(plugin.dp_group) == [rank] == dist.get_process_group_ranks(plugin.tp_group)
    assert plugin.pg_mesh.get_group_along_axis(plugin.pp_axis) is plugin.pp_group

    # execute_pipeline(return_outputs=True): the last stage gets the full model's logits
    config = tiny_config("bert", num_hidden_layers=4)
    config.num_labels = 3
    model = build_model("BertForSequenceClassification", config)
    reference = copy.deepcopy(model).eval()
    batch = tiny_batch("BertForSequenceClassification", config, batch=4, seq=8)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(model, HybridAdam(model.parameters(), lr=1e-3))
    model.eval()
    out = booster.execute_pipeline(iter([batch]), model, lambda o, i: o.loss, return_loss=True, return_outputs=True)
    expected = reference(**batch)
    torch.testing.assert_close(out["loss"], expected.loss, rtol=1e-5, atol=1e-6)
    if sm.is_last_stage(ignore_chunk=True):
        torch.testing.assert_close(out["outputs"]["logits"], expected.logits, rtol=1e-5, atol=1e-6)
    else:
        assert out["outputs"] is None
    model.train()
    out = booster.execute_pipeline(iter([batch]), model, lambda o, i: o.loss, optimizer, return_loss=True)
    optimizer.step()
    assert torch.isfinite(out["loss"])


def _tensor_parallel_attributes(rank, world):
    plugin = HybridParallelPlugin(tp_size=world, pp_size=1)
    assert plugin.stage_manager is None and plugin.pg_mesh.shape == (1, 1, world)
    assert plugin.pg_mesh.get_ranks_in_group(plugin.tp_group) == list(range(world))
    assert plugin.pg_mesh.size(plugin.tp_axis) == world and plugin.pg_mesh.coordinate(plugin.tp_axis) == rank
    assert (plugin.dp_size, plugin.pp_size, plugin.tp_size) == (1, 1, world)
    # ColossalAI's construction: cls(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=...)
    loader = plugin.prepare_dataloader(list(range(8)), batch_size=2,
                                       distributed_sampler_cls=torch.utils.data.DistributedSampler)
    assert (loader.sampler.num_replicas, loader.sampler.rank) == (1, 0) and list(loader.sampler) == list(range(8))


def _keywords(rank, world):
    ddp = HybridParallelPlugin(tp_size=1, check_reduction=True, gradient_as_bucket_view=True, static_graph=True,
                               broadcast_buffers=True, ddp_bucket_cap_mb=5, find_unused_parameters=True)
    assert (ddp.config.ddp.check_reduction, ddp.config.ddp.gradient_as_bucket_view, ddp.config.ddp.static_graph,
            ddp.config.ddp.broadcast_buffers, ddp.config.ddp.bucket_cap_mb,
            ddp.config.ddp.find_unused_parameters) == (True, True, True, True, 5, True)
    # accepted, either value (no effect on meshboost's stage traffic), and a no-op communication_dtype
    HybridParallelPlugin(tp_size=1, enable_metadata_cache=False, overlap_p2p=False, communication_dtype=torch.float32)
    for kwargs, message in REFUSED:
        with pytest.raises((NotImplementedError, ValueError), match=message):
            HybridParallelPlugin(tp_size=1, **kwargs)
    with pytest.raises(NotImplementedError, match=r"TorchDDPPlugin\(fp8_communication=True\) compresses .* 'cpu'"):
        TorchDDPPlugin(fp8_communication=True)
    assert TorchDDPPlugin(static_graph=True, fp8_communication=False).ddp_config.static_graph


def _body(rank, world):
    _keywords(rank, world)
    _tensor_parallel_attributes(rank, world)
    _pipeline_attributes(rank, world)


def test_plugin_attributes_and_keywords():
    spawn(_body, 2)
