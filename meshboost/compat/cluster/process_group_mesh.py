"""ProcessGroupMesh: ColossalAI's mesh interface as a view of a meshboost `ParallelMesh`.

Owns: axis numbers (0 = dp, 1 = pp, 2 = tp: the order of ParallelMesh, tp innermost, which is
ColossalAI's `dp_outside=True` order), shape / coordinate / rank questions, the group along an
axis, and the global ranks of a group. Must not build groups of its own: every group is the
ParallelMesh's, so a plugin's `pg_mesh` and `mesh` always agree.
"""

from __future__ import annotations

import numpy as np
import torch.distributed as dist

from meshboost.distributed import ParallelDims, ParallelMesh

AXES = ("dp", "pp", "tp")     # ColossalAI's axis numbers 0, 1, 2: meshboost's logical axes of the same names


class ProcessGroupMesh:
    """`ProcessGroupMesh(dp, pp, tp)` builds a ParallelMesh of that shape (a 4th size, ColossalAI's
    sequence axis, must be 1: meshboost runs sequence parallelism over tp); `ProcessGroupMesh(mesh=m)`
    views an existing one (what `HybridParallelPlugin.pg_mesh` is)."""

    def __init__(self, *size: int, mesh: ParallelMesh | None = None):
        if mesh is None:
            if len(size) == 4 and size[3] == 1:
                size = size[:3]
            if len(size) != 3:
                raise NotImplementedError(f"ProcessGroupMesh{size}: meshboost's mesh has the axes (dp, pp, tp); pass "
                                          "three sizes (a fourth, the sequence axis, only as 1)")
            dp, pp, tp = size
            mesh = ParallelMesh(ParallelDims(dp=dp, pp=pp, tp=tp))
        elif size:
            raise TypeError("pass either the sizes or mesh=, not both")
        self.mesh = mesh

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.size(axis) for axis in AXES)

    @property
    def rank(self) -> int:
        return self.mesh.global_rank

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def coordinate(self, dim: int | None = None):
        coord = tuple(self.mesh.coordinate(axis) for axis in AXES)
        return coord if dim is None else coord[dim]

    @staticmethod
    def unravel(rank: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(rank, shape))

    @staticmethod
    def ravel(coord: tuple[int, ...], shape: tuple[int, ...], mode: str = "raise") -> int:
        return int(np.ravel_multi_index(coord, shape, mode=mode))

    def get_ranks_in_group(self, group: dist.ProcessGroup) -> list[int]:
        """The global ranks of `group`, in the group's own rank order (along the pp axis: stage order)."""
        return dist.get_process_group_ranks(group)

    def get_group_along_axis(self, axis: int, indices_at_axis: list[int] | None = None,
                             backend: str | None = None) -> dist.ProcessGroup:
        """This rank's group along `axis` (0 = dp, 1 = pp, 2 = tp)."""
        if not isinstance(axis, int) or not 0 <= axis < len(AXES):
            raise NotImplementedError(f"axis={axis!r}: meshboost's mesh has the axes 0 = dp, 1 = pp, 2 = tp (one "
                                      "axis at a time)")
        if indices_at_axis is not None and list(indices_at_axis) != list(range(self.size(axis))):
            raise NotImplementedError(f"indices_at_axis={indices_at_axis}: groups of part of an axis are not built "
                                      "here; ParallelMesh.stage_group(pp_ranks) gives one over chosen pipeline stages")
        if backend is not None and backend != dist.get_backend():
            raise NotImplementedError(f"backend={backend!r}: the mesh's groups use the default group's backend "
                                      f"({dist.get_backend()})")
        return self.mesh.group(AXES[axis])

    create_group_along_axis = get_group_along_axis      # the groups exist already (ParallelMesh built them)

    def destroy_mesh_process_groups(self) -> None:
        """Nothing to do: the groups belong to the ParallelMesh (and go with the default group)."""
