"""DistCoordinator, get_accelerator() and the ProcessGroupMesh / PipelineStageManager views on 2
processes (gloo on CPU, NCCL with CUDA): ranks and roles, printing and decorated functions on the
master only, priority_execution's order, barriers and groups; the accelerator of the device the
process computes on; mesh shape, coordinates, groups and stage neighbours built from sizes."""

import contextlib
import io
import os
import time

import pytest
import torch
import torch.distributed as dist

import meshboost
from meshboost.accelerator import CpuAccelerator, CudaAccelerator, get_accelerator
from meshboost.cluster import DistCoordinator, PipelineStageManager, ProcessGroupMesh
from meshboost.testing import spawn


def _coordinator(rank, world, tmp):
    c = DistCoordinator()
    assert (c.rank, c.world_size, c.local_rank) == (rank, world, int(os.environ["LOCAL_RANK"]))
    assert c.is_master() == (rank == 0) and c.is_last_process() == (rank == world - 1)
    assert c.is_node_master() == (rank == 0)
    only_last = dist.new_group([world - 1])                 # collective: every rank creates it
    if rank == world - 1:
        assert c.is_master(only_last) and c.is_last_process(only_last)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        c.print_on_master("hello")
        c.print_on_node_master("node")
    assert out.getvalue() == ("hello\nnode\n" if rank == 0 else "")

    @c.on_master_only()
    def answer():
        return 42
    assert answer() == (42 if rank == 0 else None)

    # priority_execution: the executor's block finishes before anyone else's starts
    marker = os.path.join(tmp, "first")
    with c.priority_execution(executor_rank=1):
        if rank == 1:
            time.sleep(0.3)
            open(marker, "w").close()
        else:
            assert os.path.exists(marker), "rank 0 entered before the executor finished"
    c.block_all()
    if rank == world - 1:
        c.destroy(only_last)                                # a subgroup; the default group stays
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        saved = os.environ.pop("LOCAL_RANK")
        try:
            DistCoordinator().is_node_master()
        finally:
            os.environ["LOCAL_RANK"] = saved


def _accelerator(rank):
    acc = get_accelerator()
    device = meshboost.get_current_device()
    assert isinstance(acc, CudaAccelerator if device.type == "cuda" else CpuAccelerator)
    assert acc.get_current_device() == device and acc.name == device.type
    assert acc.communication_backend == dist.get_backend() and acc.is_available() and acc.device_count() >= 1
    assert isinstance(acc.current_device(), int)
    acc.set_device()                                         # the device launch bound: no change
    assert acc.get_current_device() == device
    acc.synchronize(), acc.empty_cache(), acc.reset_peak_memory_stats()
    assert acc.max_memory_allocated() >= acc.memory_allocated() >= 0 and acc.max_memory_reserved() > 0
    acc.manual_seed(123)
    a = torch.randn(4, device=device)
    acc.manual_seed(123)
    assert torch.equal(a, torch.randn(4, device=device))
    state = acc.get_rng_state()
    b = torch.randn(3, device=device)
    acc.set_rng_state(state)
    assert torch.equal(b, torch.randn(3, device=device))
    module = acc.set_to_device(torch.nn.Linear(2, 2))
    assert module.weight.device.type == device.type
    with acc.autocast(dtype=torch.bfloat16):
        assert module(torch.ones(1, 2, device=device)).dtype == torch.bfloat16
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match="no meaning on cpu"):
            acc.get_device_properties(0)
        with pytest.raises(RuntimeError, match="computes on the CPU"):
            acc.set_device("cuda:1")


def _mesh_views(rank, world):
    tp = ProcessGroupMesh(1, 1, world)                      # dp, pp, tp
    assert tp.shape == (1, 1, world) and tp.rank == rank and tp.coordinate() == (0, 0, rank)
    assert tp.size(2) == world and tp.coordinate(2) == rank
    assert tp.get_ranks_in_group(tp.get_group_along_axis(2)) == list(range(world))
    assert tp.get_ranks_in_group(tp.create_group_along_axis(0)) == [rank]
    assert ProcessGroupMesh.ravel((0, 0, 1), (1, 1, 2)) == 1 and ProcessGroupMesh.unravel(1, (1, 1, 2)) == (0, 0, 1)
    pp = ProcessGroupMesh(1, world, 1, 1)                   # ColossalAI's 4th (sequence) axis of size 1
    stages = PipelineStageManager(pp, pipeline_axis=1)
    assert stages.num_stages == world and stages.stage == rank and stages.get_rank() == rank
    assert stages.is_first_stage() == (rank == 0) and stages.is_last_stage() == (rank == world - 1)
    assert stages.get_prev_rank() == (rank - 1) % world and stages.get_next_rank() == (rank + 1) % world
    assert stages.get_stage_index([3, 5]) == ([0, 3] if rank == 0 else [3, 8])
    with pytest.raises(NotImplementedError, match="axes"):
        ProcessGroupMesh(world, 1)
    with pytest.raises(NotImplementedError, match="stage_group"):
        pp.get_group_along_axis(1, indices_at_axis=[0])
    with pytest.raises(NotImplementedError, match="zero-bubble"):
        PipelineStageManager(pp, 1, enable_interleave=True, use_zbv=True, num_model_chunks=2)


def _body(rank, world, tmp):
    _coordinator(rank, world, tmp)
    _accelerator(rank)
    _mesh_views(rank, world)


def test_coordinator_accelerator_and_mesh_views(tmp_path):
    spawn(_body, 2, str(tmp_path))
