"""ParallelMesh: the (dp, pp, tp) process-group mesh, built once and passed down.

Owns: agreeing that every rank asks for the same mesh (and, for plugins, the same settings:
`agree_settings`), validating the factorisation of the world, building the groups through torch's
DeviceMesh with the default group's timeout, answering "which group / size / coordinate" for each
axis, the device this rank computes on, and the group joining the first and last pipeline stage
(weights tied across them). Must not hold module-level state: two meshes can coexist in one process.

Axis order is (dp, pp, tp) with tp innermost, so the ranks of one tensor-parallel group are
adjacent (on one node when tp <= GPUs per node) and its all-reduces stay on the fastest links.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.launch import get_current_device, group_timeout

AXES = ("dp", "pp", "tp")


def check_mesh_shape(world_size: int, tp_size: int, pp_size: int, dp_size: int | None = None) -> int:
    """Validate the factors and return dp_size. Pure: raises the same error on every rank."""
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if dp_size is None:
        if world_size % (tp_size * pp_size) != 0:
            raise ValueError(
                f"world_size={world_size} is not divisible by tp_size * pp_size = {tp_size} * {pp_size} "
                f"= {tp_size * pp_size}; launch a multiple of {tp_size * pp_size} processes or change "
                "tp_size/pp_size")
        dp_size = world_size // (tp_size * pp_size)
    if dp_size * pp_size * tp_size != world_size:
        raise ValueError(
            f"dp_size * pp_size * tp_size = {dp_size} * {pp_size} * {tp_size} = "
            f"{dp_size * pp_size * tp_size} must equal world_size={world_size}")
    return dp_size


class ParallelMesh:
    """A named (dp, pp, tp) mesh over all ranks of the default process group.

    >>> mesh = ParallelMesh(tp_size=2, pp_size=1)   # dp inferred from the world size
    >>> mesh.tp_group, mesh.tp_size, mesh.tp_rank, mesh.device
    """

    def __init__(self, tp_size: int = 1, pp_size: int = 1, dp_size: int | None = None,
                 device_type: str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs an initialised process group: call "
                               "meshboost.launch_from_torch() first")
        current = get_current_device()
        device_type = device_type or current.type
        # Before anything that could differ by rank: ranks with different shapes would build different
        # groups and hang in torch's group creation.
        agree_settings({"tp_size": tp_size, "pp_size": pp_size, "dp_size": dp_size, "device_type": device_type},
                       "mesh shape (ParallelMesh arguments)")
        self.world_size = dist.get_world_size()
        self.dp_size = check_mesh_shape(self.world_size, tp_size, pp_size, dp_size)
        self.pp_size, self.tp_size = pp_size, tp_size
        # The device every tensor this mesh's collectives touch lives on (launch bound cuda:LOCAL_RANK).
        self.device: torch.device = current if current.type == device_type else torch.device(device_type)
        # Every group inherits the default group's timeout (launch_from_torch(timeout=...)); torch would
        # give new groups its own default instead.
        self.timeout = group_timeout()
        self.device_mesh: DeviceMesh = init_device_mesh(
            device_type, (self.dp_size, self.pp_size, self.tp_size), mesh_dim_names=AXES,
            **self._timeout_override(device_type))
        self.global_rank = dist.get_rank()
        self.dp_rank, self.pp_rank, self.tp_rank = self.device_mesh.get_coordinate()
        self._stage_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}

    def _timeout_override(self, device_type: str) -> dict:
        """DeviceMesh creates its groups with torch's default timeout unless given backend options
        carrying another one; only pass them when the timeout is not torch's default."""
        backend = dist.get_backend()
        default = default_pg_timeout if backend == "gloo" else default_pg_nccl_timeout
        if self.timeout is None or backend not in ("gloo", "nccl") or self.timeout == default:
            return {}
        options = dist.ProcessGroupGloo._Options() if backend == "gloo" else dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        return {"backend_override": {axis: (backend, options) for axis in AXES}}

    # -- groups -------------------------------------------------------------------------------
    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group along `axis` ("dp", "pp" or "tp") that contains this rank."""
        if axis not in AXES:
            raise ValueError(f"axis={axis!r}; expected one of {AXES}")
        return self.device_mesh.get_group(axis)

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.group("pp")

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.group("tp")

    @property
    def world_group(self) -> dist.ProcessGroup:
        """Every rank of the mesh (the default group): overflow and norms are agreed over it."""
        return dist.group.WORLD

    def stage_group(self, pp_ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The group of the pipeline ranks `pp_ranks` (those holding one tied weight) at this rank's
        (dp, tp) coordinate, or None when this rank's stage is not among them. Built on first call for
        a given set: every rank must make that call, since torch creates one group per (dp, tp)
        coordinate collectively."""
        pp_ranks = tuple(sorted(pp_ranks))
        if pp_ranks not in self._stage_groups:
            mine = None
            grid = self.device_mesh.mesh
            for d in range(self.dp_size):
                for t in range(self.tp_size):
                    ranks = [int(grid[d, p, t]) for p in pp_ranks]
                    group = dist.new_group(ranks, timeout=self.timeout)
                    if self.global_rank in ranks:
                        mine = group
            self._stage_groups[pp_ranks] = mine
        return self._stage_groups[pp_ranks]

    def tied_stage_group(self) -> dist.ProcessGroup | None:
        """The group {first stage, last stage} of this rank's (dp, tp) coordinate (GPT-2's `wte` and
        `lm_head`), or None on a middle stage and with pp_size == 1; collective like `stage_group`."""
        return self.stage_group((0, self.pp_size - 1)) if self.pp_size > 1 else None

    def size(self, axis: str) -> int:
        return {"dp": self.dp_size, "pp": self.pp_size, "tp": self.tp_size}[axis]

    def coordinate(self, axis: str) -> int:
        return {"dp": self.dp_rank, "pp": self.pp_rank, "tp": self.tp_rank}[axis]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        return (f"ParallelMesh(dp={self.dp_size}, pp={self.pp_size}, tp={self.tp_size}; rank "
                f"{self.global_rank} at dp={self.dp_rank}, pp={self.pp_rank}, tp={self.tp_rank}; {self.device})")
