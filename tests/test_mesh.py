"""ParallelMesh and launch: factor checks, tp innermost, groups and coordinates, two meshes in one
process, and the torchrun-environment check."""

import pytest
import torch
import torch.distributed as dist

import meshboost
from meshboost.distributed.dims import ParallelDims, check_mesh_shape
from meshboost.distributed.mesh import ParallelMesh
from meshboost.distributed.param_info import GradReduction, carry_records, set_grad_reduction
from meshboost.testing import spawn


def test_check_mesh_shape_messages():
    assert check_mesh_shape(8, tp_size=2, pp_size=2) == 2
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by tp_size x pp_size x cp_size = 4 x 1 x 1 = 4; launch a multiple of 4"):
        check_mesh_shape(6, tp_size=4, pp_size=1)
    with pytest.raises(ValueError, match=r"dp_size x pp_size x cp_size x tp_size = 3 x 1 x 1 x 2 = 6 must equal world_size=4"):
        check_mesh_shape(4, tp_size=2, pp_size=1, dp_size=3)
    with pytest.raises(ValueError, match="tp_size=0"):
        check_mesh_shape(4, tp_size=0, pp_size=1)


def test_parallel_dims_are_the_one_answer_for_sizes():
    dims = ParallelDims.of_world(8, tp=2, pp=2)
    assert (dims.dp, dims.pp, dims.tp, dims.shape) == (2, 2, 2, (2, 2, 2))
    assert dims.size("dp", "tp") == 4 and dims.grad_axes() == ("dp",)
    with pytest.raises(ValueError, match="axis='fsdp'"):
        dims.size("fsdp")
    assert dims.size("cp") == 1                              # no context parallelism: one rank along cp
    with pytest.raises(ValueError, match="parameter kind 'context'"):
        dims.grad_axes("context")
    with pytest.raises(ValueError, match="not divisible"):
        ParallelDims.of_world(6, tp=4)
    # expert parallelism factors dp as (edp, ep): experts averaged over their own replicas
    ep = ParallelDims.of_world(8, tp=2, ep=2)
    assert (ep.dp, ep.ep, ep.edp, ep.mesh_axes, ep.shape) == (4, 2, 2, ("edp", "ep", "pp", "tp"), (2, 2, 1, 2))
    assert ep.grad_axes("expert") == ("edp",) and dims.mesh_axes == ("dp", "pp", "tp")
    # context parallelism: a cp axis beside tp; every weight is averaged over dp x cp
    cp = ParallelDims.of_world(8, tp=2, cp=2)
    assert (cp.dp, cp.mesh_axes, cp.shape, cp.grad_axes()) == (2, ("dp", "pp", "cp", "tp"), (2, 1, 2, 2), ("dp", "cp"))
    with pytest.raises(ValueError, match="ep_size=3 does not divide the data-parallel size 4"):
        ParallelDims.of_world(8, tp=2, ep=3)
    # HSDP factors dp as (dp_replicate, dp_shard): ZeRO-3 shards inside a group, replicates across groups
    hsdp = ParallelDims.of_world(8, tp=2, dp_replicate=2)
    assert (hsdp.dp, hsdp.dp_shard, hsdp.mesh_axes, hsdp.shape) == (4, 2, ("dp_replicate", "dp_shard", "pp", "tp"),
                                                                      (2, 2, 1, 2))
    assert hsdp.grad_axes() == ("dp",) and hsdp.shard_axes() == (("dp_replicate",), ("dp_shard",))
    assert ParallelDims.of_world(8, cp=2, dp_replicate=2).shard_axes() == (("dp_replicate",), ("dp_shard", "cp"))
    assert dims.shard_axes() == ((), ("dp",)) and dims.dp_shard == dims.dp
    with pytest.raises(ValueError, match="dp_replicate_size=3 does not divide the data-parallel size 4"):
        ParallelDims.of_world(8, tp=2, dp_replicate=3)
    # HSDP with ep (torchtitan's layout): ep borrows from dp_shard, dp = (dp_replicate, edp_shard, ep)
    both = ParallelDims.of_world(8, ep=2, dp_replicate=2)
    assert (both.mesh_axes, both.shape, both.edp, both.edp_shard) == (
        ("dp_replicate", "edp_shard", "ep", "pp", "tp"), (2, 2, 2, 1, 1), 4, 2)
    assert both.shard_axes() == (("dp_replicate",), ("dp_shard",))
    assert both.shard_axes("expert") == (("dp_replicate",), ("edp_shard",))
    with pytest.raises(ValueError, match=r"dp_replicate_size=4 does not divide the experts' data-parallel size 2 "
                                         r"\(edp = dp 8 / ep_size=4\).*dividing 2, or an ep_size dividing 2"):
        ParallelDims.of_world(8, ep=4, dp_replicate=4)


def test_launch_from_torch_needs_torchrun_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        meshboost.launch_from_torch()


def _mesh_body(rank, world):
    mesh = ParallelMesh(ParallelDims(tp=2))                 # dp = 2
    assert (mesh.dp_size, mesh.pp_size, mesh.tp_size) == (2, 1, 2)
    assert dist.get_process_group_ranks(mesh.tp_group) == [rank // 2 * 2, rank // 2 * 2 + 1], "tp not innermost"
    assert dist.get_process_group_ranks(mesh.dp_group) == [rank % 2, rank % 2 + 2]
    assert (mesh.dp_rank, mesh.tp_rank) == (rank // 2, rank % 2)
    # A second mesh in the same process, another shape: both stay usable.
    other = ParallelMesh(ParallelDims(pp=2))                # dp = 2, pp = 2
    assert dist.get_process_group_ranks(other.pp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.tp_group)
    assert t.item() == 2
    t = torch.ones(1)
    dist.all_reduce(t, group=other.dp_group)
    assert t.item() == 2
    # A bad factorisation raises on every rank before any collective (no rank hangs).
    with pytest.raises(ValueError, match="world_size=4 is not divisible by tp_size x pp_size x cp_size = 3 x 1 x 1"):
        ParallelMesh(ParallelDims(tp=3))
    # named axes: sizes from the dims, several axes flattened into one group
    assert mesh.dims == ParallelDims(dp=2, pp=1, tp=2) and mesh.size("dp", "tp") == 4
    assert dist.get_process_group_ranks(mesh.group("dp", "tp")) == [0, 1, 2, 3]
    # who reduces a gradient: the parameter's record, answered by the mesh (dense: over dp)
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    axes, group, size, index = mesh.reduction_of([w, b])
    assert (axes, size, index) == (("dp",), 2, rank // 2) and group is mesh.dp_group
    assert mesh.reduction_rank(w) == rank // 2
    set_grad_reduction(b, GradReduction("context"))         # a kind this mesh has no axis for yet
    with pytest.raises(ValueError, match="parameter kind 'context'"):
        mesh.reduction_of([w, b])
    ParallelDims.GRAD_AXES["context"] = ("tp",)              # as a context axis will add its own kind
    try:
        assert mesh.reduction_of([b])[:3] == (("tp",), mesh.tp_group, 2)
        with pytest.raises(NotImplementedError, match=r"\(2,\) over \('dp',\), \(2,\) over \('tp',\)"):
            mesh.reduction_of([w, b])                        # one reducer, two groups: refused
    finally:
        del ParallelDims.GRAD_AXES["context"]
    moved = torch.nn.Parameter(torch.ones(2))
    carry_records(b, moved)                                  # the record travels with a replacement
    assert moved.grad_reduction == GradReduction("context")
    # expert parallelism: ep = 2 of the 4 dp ranks (ep inner), edp their replicas; dp stays every replica
    ep = ParallelMesh(ParallelDims(ep=2))
    assert (ep.dp_size, ep.ep_size, ep.dp_rank, ep.ep_rank, ep.edp_rank) == (4, 2, rank, rank % 2, rank // 2)
    assert dist.get_process_group_ranks(ep.group("ep")) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(ep.group("edp")) == [rank % 2, rank % 2 + 2]
    assert dist.get_process_group_ranks(ep.dp_group) == [0, 1, 2, 3]
    set_grad_reduction(b, GradReduction("expert"))
    assert ep.reduction_of([b])[0] == ("edp",) and ep.reduction_rank(b) == rank // 2
    # with tp inside: the ep group joins the dp replicas at this tp coordinate, one replica of each expert
    both = ParallelMesh(ParallelDims(tp=2, ep=2))
    assert dist.get_process_group_ranks(both.group("ep")) == [rank % 2, rank % 2 + 2] and both.dims.edp == 1
    assert mesh.reduction_of([b])[1] is mesh.dp_group        # without ep, edp is dp: the expert kind is dp's
    # HSDP with ep: dp = (dp_replicate, edp_shard, ep) = (2, 1, 2); a replica group holds every expert once
    hsdp = ParallelMesh(ParallelDims(ep=2, dp_replicate=2))
    assert (hsdp.dp_rank, hsdp.ep_rank, hsdp.edp_rank, hsdp.coordinate("dp_shard"), hsdp.coordinate("edp_shard")) \
        == (rank, rank % 2, rank // 2, rank % 2, 0)
    assert dist.get_process_group_ranks(hsdp.group("dp_shard")) == [rank // 2 * 2, rank // 2 * 2 + 1]
    assert dist.get_process_group_ranks(hsdp.group("edp")) == [rank % 2, rank % 2 + 2]
    assert hsdp.fsdp_mesh().shape == (2, 2) and hsdp.fsdp_mesh("expert").mesh_dim_names == ("dp_replicate",
                                                                                           "edp_shard")
    assert ep.coordinate("edp_shard") == ep.edp_rank and mesh.coordinate("edp_shard") == mesh.dp_rank
    # context parallelism: cp beside tp, dense gradients over dp x cp
    cp = ParallelMesh(ParallelDims(tp=2, cp=2))
    assert (cp.dp_size, cp.cp_size, cp.cp_rank, cp.tp_rank) == (1, 2, rank // 2, rank % 2)
    assert dist.get_process_group_ranks(cp.group("cp")) == [rank % 2, rank % 2 + 2]
    assert cp.reduction_of([w])[0] == ("dp", "cp") and dist.get_process_group_ranks(cp.reduction_of([w])[1]) == \
        [rank % 2, rank % 2 + 2]
    assert torch.equal(hsdp.device_mesh.mesh, hsdp.dims.rank_grid())      # the mesh is the dims' own grid
    # launch seeded every rank identically
    assert meshboost.get_current_device().type in ("cpu", "cuda")


def test_mesh_groups_on_four_ranks():
    spawn(_mesh_body, 4)


def test_groups_and_coordinates_are_one_grid():
    """dims.py's one algebra: for every layout shape (ep, HSDP, both, cp), a rank's coordinate along each
    logical axis is its index in its own group along that axis, the groups of an axis partition the world,
    and a logical axis's size is its groups' size; "dp" unfolds into dp_replicate x dp_shard and edp x ep."""
    for dims in (ParallelDims.of_world(8, tp=2, pp=2), ParallelDims.of_world(8, ep=2), ParallelDims.of_world(8, tp=2, cp=2),
                 ParallelDims.of_world(8, dp_replicate=2), ParallelDims.of_world(8, ep=2, dp_replicate=2),
                 ParallelDims.of_world(16, tp=2, ep=2, dp_replicate=2)):
        for axis in ("dp", "edp", "ep", "dp_shard", "edp_shard", "dp_replicate", "pp", "cp", "tp"):
            groups = dims.groups(axis)
            assert sorted(r for g in groups for r in g) == list(range(dims.world)), (dims, axis)
            assert {len(g) for g in groups} == {dims.size(axis)}, (dims, axis)
            for group in groups:
                for index, rank in enumerate(group):
                    assert dims.coordinates(rank)[axis] == index, (dims, axis, rank)
        for rank in range(dims.world):
            c = dims.coordinates(rank)
            assert c["dp"] == c["edp"] * dims.ep + c["ep"] == c["dp_replicate"] * dims.dp_shard + c["dp_shard"]
    both = ParallelDims.of_world(8, ep=2, dp_replicate=2)      # torchtitan's layout: ep inside a replica group
    assert both.groups("edp") == [(0, 2, 4, 6), (1, 3, 5, 7)] and both.groups("dp_shard") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert both.mesh_dims("dp") == ("dp_replicate", "edp_shard", "ep") and both.mesh_dims("cp", "ep") == ("ep",)
    with pytest.raises(ValueError, match="axis='fsdp'; expected one of"):
        both.mesh_dims("fsdp")
