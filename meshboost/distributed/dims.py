"""ParallelDims: the parallel layout's one record and its whole algebra. Owns how large each axis is,
which DeviceMesh dimensions stand behind each logical axis (`mesh_dims`), the rank grid both the runtime
mesh and the planner read their groups from (`rank_grid`, `groups`, `coordinates`), which axes average
or shard a parameter's gradient, and the one validation of a world's factorisation (`check_mesh_shape`).
Pure: no process group; `ParallelMesh` (mesh.py) builds the groups of one, and the planner reads the same
record. Nothing else maps logical axes to mesh dimensions (tests/test_architecture.py checks it).

The mesh's dimensions, outermost first, are (dp, pp, cp, tp): tp innermost, so the ranks of one
tensor-parallel group are adjacent (on one node when tp <= GPUs per node) and its all-reduces stay on
the fastest links; cp beside it (a dimension only at cp > 1). The data-parallel axis is unfolded into the
dimensions its factors need (torchtitan's `unfold_dp_axis` is the model):

    ep == 1, dp_replicate == 1:   dp
    ep  > 1:                      edp, ep                        dp rank = edp rank x ep + ep rank
    dp_replicate > 1:             dp_replicate, dp_shard         dp rank = replica x dp_shard + shard rank
    both:                         dp_replicate, edp_shard, ep    (ep borrows from dp_shard, as torchtitan)

The logical axes are then the dp dimensions with some factors left out: "dp" is all of them (dense
gradients are averaged over it), "dp_shard" leaves out the replicas (ZeRO-3 shards over it), "edp" leaves
out ep (an expert's replicas), "edp_shard" both; "ep", "dp_replicate" and "cp" are their own dimension,
or span nothing at size 1. A logical axis's coordinate is the row-major index over its dimensions.

Adding an axis: a field here, its dimension in `mesh_axes`, and, when parameters' gradients are averaged
over it, its entry in `GRAD_AXES` (a context axis made dense gradients reduce over ("dp", "cp"); the
expert axis added the kind "expert", reduced over "edp"). Parameters carry their kind in their record
(`param_info.GradReduction`), and the reducers ask the mesh for that group (`reduction_of`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch

from meshboost.distributed.param_info import DENSE, EXPERT


class Axis(str, Enum):
    """A logical axis of the layout, by the name users and the runtime write ("dp", "tp", ...)."""

    DP = "dp"
    PP = "pp"
    TP = "tp"
    CP = "cp"
    EP = "ep"
    EDP = "edp"                     # an expert's replicas: dp without ep
    DP_REPLICATE = "dp_replicate"   # HSDP's replica groups
    DP_SHARD = "dp_shard"           # the ranks of one replica group: dp without the replicas
    EDP_SHARD = "edp_shard"         # an expert's replicas inside one replica group

    __str__ = str.__str__
    __format__ = str.__format__


# the factors each data-parallel logical axis leaves out of the dp dimensions
_DP_AXES_WITHOUT = {Axis.DP: (), Axis.DP_SHARD: (Axis.DP_REPLICATE,), Axis.EDP: (Axis.EP,),
                    Axis.EDP_SHARD: (Axis.EP, Axis.DP_REPLICATE)}
# the mesh dimensions the data-parallel axis is unfolded into (`ParallelDims.mesh_axes`)
_DP_DIMS = ("dp", "edp", "ep", "dp_replicate", "dp_shard", "edp_shard")


def check_degrees(**degrees) -> None:
    """Each axis degree (tp=, pp=, ep=, cp=, dp_replicate=, dp=) a positive integer, named as the keyword
    users write (tp_size=...; cp_size is ColossalAI's sp_size). Pure: the same error on every rank."""
    for axis, value in degrees.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{axis}_size={value!r} must be a positive integer"
                             + (" (cp_size: ColossalAI's sp_size)" if axis == "cp" else ""))


def check_mesh_shape(world_size: int, tp_size: int, pp_size: int, dp_size: int | None = None,
                     ep_size: int = 1, cp_size: int = 1, dp_replicate: int = 1) -> int:
    """The factorisation's one validation: return dp_size (the rest of the world when None). Pure: the same
    error on every rank, naming the factor that fails, its fix, and every factor asked for once."""
    check_degrees(tp=tp_size, pp=pp_size, ep=ep_size, cp=cp_size, dp_replicate=dp_replicate)
    if dp_size is not None:
        check_degrees(dp=dp_size)
    model = tp_size * pp_size * cp_size
    asked = (f"world_size={world_size} = dp_size={'?' if dp_size is None else dp_size} x pp_size={pp_size} x "
             f"cp_size={cp_size} x tp_size={tp_size}, with ep_size={ep_size} and dp_replicate_size={dp_replicate} "
             "inside dp")

    def refuse(problem: str, fix: str):
        raise ValueError(f"{problem}; {fix} (the layout asked for: {asked})")

    if world_size % model:
        refuse(f"world_size={world_size} is not divisible by tp_size x pp_size x cp_size = {tp_size} x {pp_size} x "
               f"{cp_size} = {model}", f"launch a multiple of {model} processes or change the sizes")
    if dp_size is not None and dp_size * model != world_size:
        refuse(f"dp_size x pp_size x cp_size x tp_size = {dp_size} x {pp_size} x {cp_size} x {tp_size} = "
               f"{dp_size * model} must equal world_size={world_size}",
               "leave dp_size out (it is the rest of the world) or change the sizes")
    dp = world_size // model
    if dp % ep_size:
        refuse(f"ep_size={ep_size} does not divide the data-parallel size {dp}",
               f"expert parallelism splits the experts over data-parallel ranks; choose an ep_size dividing {dp}, "
               f"or launch a multiple of {model * ep_size} processes")
    if dp % dp_replicate:
        refuse(f"dp_replicate_size={dp_replicate} does not divide the data-parallel size {dp}",
               f"HSDP splits the dp ranks into dp_replicate_size groups that each shard the model; choose a divisor "
               f"of {dp}, or launch a multiple of {model * dp_replicate} processes")
    if dp_replicate > 1 and ep_size > 1 and (dp // ep_size) % dp_replicate:
        # torchtitan's layout: ep borrows its ranks from inside one replica group (dp_shard), so each replica
        # group holds every expert once and the replicas of one expert (edp) split into the same groups
        refuse(f"dp_replicate_size={dp_replicate} does not divide the experts' data-parallel size {dp // ep_size} "
               f"(edp = dp {dp} / ep_size={ep_size})",
               f"HSDP with expert parallelism puts the ep ranks inside one replica group of dp / dp_replicate_size "
               f"ranks; choose a dp_replicate_size dividing {dp // ep_size}, or an ep_size dividing "
               f"{dp // dp_replicate}")
    return dp


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout's one record: the size of every named axis, the context-parallel mode and the
    tensor-parallel axis' mode (Megatron sequence parallelism, `sequence_parallel`). The
    one answer to "how large is tp" and "which ranks form a dp group" (the plugin's config holds one, the
    mesh is built from one, the planner lays out its candidates as one). Pure: each instance checks its
    degrees when built; `dp=None` means "the rest of the world" until `resolved(world_size)` (the mesh)
    fixes it."""

    dp: int | None = None
    pp: int = 1
    tp: int = 1
    ep: int = 1          # experts split over this many of the dp ranks (ep divides dp)
    cp: int = 1          # context parallelism: the sequence split over this many ranks (ColossalAI's sp_size)
    dp_replicate: int = 1   # HSDP: dp = dp_replicate x dp_shard; ZeRO-3 shards inside a replica group
    # how the cp ranks attend (shardformer/context_checks.py names and checks the modes; None at cp == 1)
    cp_mode: str | None = None
    # Megatron sequence parallelism, a mode of the tp axis (ColossalAI's enable_sequence_parallelism with
    # "split_gather"): norms, dropouts and residuals hold 1/tp of the sequence (shardformer/sequence.py); the
    # sharder, the plugin and the planner read it here. At tp == 1 it splits nothing (the sharder says so)
    sequence_parallel: bool = False

    # kind of parameter -> the axes its gradient is averaged over (its data-parallel replicas)
    GRAD_AXES = {DENSE: ("dp",), EXPERT: ("edp",)}

    def __post_init__(self):
        check_degrees(tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp, dp_replicate=self.dp_replicate)
        if self.dp is not None:
            check_degrees(dp=self.dp)
            if self.dp % self.ep:
                raise ValueError(f"ep_size={self.ep} does not divide the data-parallel size {self.dp}: expert "
                                 f"parallelism splits the experts over data-parallel ranks; choose an ep_size "
                                 f"dividing {self.dp}")
        if self.cp_mode is not None and not isinstance(self.cp_mode, str):
            raise TypeError(f"cp_mode={self.cp_mode!r}: pass a mode name (or None)")
        if self.cp == 1 and self.cp_mode is not None:
            raise ValueError(f"cp_mode={self.cp_mode!r} with cp_size=1 splits nothing; pass cp_size > 1 (the ranks "
                             "the sequence is split over), or no mode")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel={self.sequence_parallel!r}: pass True (Megatron sequence parallelism "
                            "over the tp ranks) or False")
        if self.sequence_parallel and self.cp > 1:
            raise ValueError(f"cp_size={self.cp} with sequence_parallel=True (ColossalAI's "
                             "enable_sequence_parallelism=True (split_gather over the tp group)): the context modes "
                             "split the sequence over ranks of their own; turn one off")

    @classmethod
    def of_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
                 ep: int = 1, cp: int = 1, dp_replicate: int = 1, cp_mode: str | None = None,
                 sequence_parallel: bool = False) -> "ParallelDims":
        return cls(dp=check_mesh_shape(world_size, tp, pp, dp, ep, cp, dp_replicate), pp=pp, tp=tp, ep=ep, cp=cp,
                   dp_replicate=dp_replicate, cp_mode=cp_mode, sequence_parallel=sequence_parallel)

    def resolved(self, world_size: int) -> "ParallelDims":
        """These dims over a world of `world_size` ranks, dp computed (or checked when given): the
        factorisation's one validation (`check_mesh_shape`)."""
        return self.of_world(world_size, tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, cp=self.cp,
                             dp_replicate=self.dp_replicate, cp_mode=self.cp_mode,
                             sequence_parallel=self.sequence_parallel)

    def _dp(self) -> int:
        if self.dp is None:
            raise ValueError("ParallelDims(dp=None) is not resolved against a world yet: ask "
                             "dims.resolved(world_size) (ParallelMesh does) for the data-parallel size")
        return self.dp

    @property
    def edp(self) -> int:
        """The replicas of one expert: dp / ep (dp itself without expert parallelism)."""
        return self._dp() // self.ep

    @property
    def dp_shard(self) -> int:
        """The ranks of one HSDP replica group, over which ZeRO-3 shards (dp itself without HSDP)."""
        return self._dp() // self.dp_replicate

    @property
    def edp_shard(self) -> int:
        """The replicas of one expert inside one HSDP replica group, over which ZeRO-3 shards the experts
        (edp itself without HSDP)."""
        return self.edp // self.dp_replicate

    @property
    def world(self) -> int:
        return self._dp() * self.pp * self.cp * self.tp

    # -- the mesh's dimensions and what stands behind each logical axis ----------------------------
    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The DeviceMesh's dimension names, outermost first: the dp dimensions (the module docstring's
        table), pp, cp at cp > 1, tp."""
        dp = (("dp_replicate",) if self.dp_replicate > 1 else ()) + (
            ("edp_shard", "ep") if self.ep > 1 and self.dp_replicate > 1 else ("edp", "ep") if self.ep > 1 else
            ("dp_shard",) if self.dp_replicate > 1 else ("dp",))
        return (*dp, "pp", *(("cp",) if self.cp > 1 else ()), "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        sizes = {"dp": self._dp(), "edp": self.edp, "ep": self.ep, "dp_replicate": self.dp_replicate,
                 "dp_shard": self.dp_shard, "edp_shard": self.edp_shard, "pp": self.pp, "cp": self.cp, "tp": self.tp}
        return tuple(sizes[name] for name in self.mesh_axes)

    def mesh_dims(self, *axes: str) -> tuple[str, ...]:
        """The DeviceMesh dimensions behind the logical `axes` together, in the mesh's order: the one map
        from logical axes to mesh dimensions. A data-parallel axis is the dp dimensions less the factors it
        leaves out; an axis of one rank that is no mesh dimension (ep, cp, dp_replicate at size 1) spans none."""
        names = self.mesh_axes
        dp_dims = [d for d in names if d in _DP_DIMS]
        wanted: set[str] = set()
        for axis in axes:
            axis = _axis(axis)
            if axis in _DP_AXES_WITHOUT:
                left_out = {str(a) for a in _DP_AXES_WITHOUT[axis]}
                wanted |= {d for d in dp_dims if d not in left_out}
            elif axis in names:
                wanted.add(axis.value)
        return tuple(d for d in names if d in wanted)

    def size(self, *axes: str) -> int:
        """The number of ranks along `axes` together (one axis, or several flattened)."""
        dims = self.mesh_dims(*axes)
        return math.prod(s for name, s in zip(self.mesh_axes, self.shape) if name in dims)

    def rank_grid(self) -> torch.Tensor:
        """Every global rank at its place in the mesh: `arange(world)` row-major over `shape`, the grid the
        runtime's DeviceMesh is built on and the planner reads its groups from."""
        return torch.arange(self.world).reshape(self.shape)

    def groups(self, *axes: str) -> list[tuple[int, ...]]:
        """Every group of global ranks along the logical `axes` together (one per coordinate of the other
        dimensions), each in the order of its ranks' coordinate along `axes`."""
        names, dims = self.mesh_axes, self.mesh_dims(*axes)
        along = [names.index(d) for d in dims]
        others = [i for i in range(len(names)) if i not in along]
        grid = self.rank_grid().permute(*others, *along).reshape(-1, math.prod(self.shape[i] for i in along))
        return [tuple(int(r) for r in row) for row in grid]

    def coordinates(self, rank: int) -> dict[str, int]:
        """`rank`'s index along every logical axis: the row-major index over that axis's dimensions."""
        where = dict(zip(self.mesh_axes, (int(i) for i in torch.nonzero(self.rank_grid() == rank)[0])))
        out = {}
        for axis in Axis:
            index = 0
            for name in self.mesh_dims(axis):
                index = index * self.shape[self.mesh_axes.index(name)] + where[name]
            out[axis.value] = index
        return out

    # -- who averages and who shards a gradient ------------------------------------------------------
    def grad_axes(self, kind: str = DENSE) -> tuple[str, ...]:
        """The axes a `kind` parameter's gradient is averaged over (with context parallelism every weight
        is replicated over the cp ranks too, each of which saw another part of the sequences)."""
        if kind not in self.GRAD_AXES:
            raise ValueError(f"parameter kind {kind!r}; this mesh reduces {sorted(self.GRAD_AXES)}")
        return (*self.GRAD_AXES[kind], "cp") if self.cp > 1 else self.GRAD_AXES[kind]

    def shard_axes(self, kind: str = DENSE) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(replicate axes, shard axes) of a `kind` parameter under ZeRO-3: its gradient axes (`split_axes`)."""
        return self.split_axes(self.grad_axes(kind))

    def split_axes(self, axes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(replicate axes, shard axes) of gradient `axes` under ZeRO-3: at dp_replicate > 1 dp splits into
        HSDP's replicas and dp_shard, and edp (the experts' replicas) into the replicas and edp_shard (no
        replicate axis otherwise)."""
        if self.dp_replicate == 1:
            return (), axes
        inside = {"dp": "dp_shard", "edp": "edp_shard" if self.ep > 1 else "dp_shard"}
        return ("dp_replicate",), tuple(inside.get(axis, axis) for axis in axes)


def _axis(name: str) -> Axis:
    try:
        return Axis(name)
    except ValueError:
        raise ValueError(f"axis={name!r}; expected one of {tuple(a.value for a in Axis)}") from None
