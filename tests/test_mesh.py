"""ParallelMesh and launch: factor checks, tp innermost, groups and coordinates, two meshes in one
process, and the torchrun-environment check."""

import pytest
import torch
import torch.distributed as dist

import meshboost
from meshboost.distributed.mesh import ParallelMesh, check_mesh_shape
from meshboost.testing import spawn


def test_check_mesh_shape_messages():
    assert check_mesh_shape(8, tp_size=2, pp_size=2) == 2
    with pytest.raises(ValueError, match=r"world_size=6 is not divisible by tp_size \* pp_size = 4 \* 1"):
        check_mesh_shape(6, tp_size=4, pp_size=1)
    with pytest.raises(ValueError, match=r"dp_size \* pp_size \* tp_size = 3 \* 1 \* 2 = 6 must equal world_size=4"):
        check_mesh_shape(4, tp_size=2, pp_size=1, dp_size=3)
    with pytest.raises(ValueError, match="tp_size=0"):
        check_mesh_shape(4, tp_size=0, pp_size=1)


def test_launch_from_torch_needs_torchrun_env(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        meshboost.launch_from_torch()


def _mesh_body(rank, world):
    mesh = ParallelMesh(tp_size=2, pp_size=1)                 # dp = 2
    assert (mesh.dp_size, mesh.pp_size, mesh.tp_size) == (2, 1, 2)
    assert dist.get_process_group_ranks(mesh.tp_group) == [rank // 2 * 2, rank // 2 * 2 + 1], "tp not innermost"
    assert dist.get_process_group_ranks(mesh.dp_group) == [rank % 2, rank % 2 + 2]
    assert (mesh.dp_rank, mesh.tp_rank) == (rank // 2, rank % 2)
    # A second mesh in the same process, another shape: both stay usable.
    other = ParallelMesh(tp_size=1, pp_size=2)                # dp = 2, pp = 2
    assert dist.get_process_group_ranks(other.pp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    t = torch.ones(1)
    dist.all_reduce(t, group=mesh.tp_group)
    assert t.item() == 2
    t = torch.ones(1)
    dist.all_reduce(t, group=other.dp_group)
    assert t.item() == 2
    # A bad factorisation raises on every rank before any collective (no rank hangs).
    with pytest.raises(ValueError, match="world_size=4 is not divisible by tp_size \\* pp_size = 3"):
        ParallelMesh(tp_size=3)
    # launch seeded every rank identically
    assert meshboost.get_current_device().type in ("cpu", "cuda")


def test_mesh_groups_on_four_ranks():
    spawn(_mesh_body, 4)
