"""ParallelMesh: the process-group mesh over named axes, built once and passed down.

Owns: `ParallelDims`, the one answer to "how large is each axis" (and which axes average a
parameter's gradient over its replicas), agreeing that every rank asks for the same mesh (and, for
plugins, the same settings: `agree_settings`), validating the factorisation of the world, building the
groups through torch's DeviceMesh with the default group's timeout (one axis, or several flattened
into one group), answering "which group / size / coordinate" for each axis, the device this rank
computes on, and the group joining the first and last pipeline stage (weights tied across them).
Must not hold module-level state: two meshes can coexist in one process.

Axis order is (dp, pp, tp) with tp innermost, so the ranks of one tensor-parallel group are
adjacent (on one node when tp <= GPUs per node) and its all-reduces stay on the fastest links. With
expert parallelism (ep > 1) the data-parallel axis is factored as (edp, ep), ep inner: dp rank
d = edp_rank * ep + ep_rank. The ep ranks of one (pp, tp) coordinate split the experts and exchange
tokens; the edp ranks hold the same experts (the experts' own data-parallel replicas); "dp" is the
two flattened, over which dense weights are averaged as before. With hybrid sharding (HSDP,
dp_replicate > 1) the data-parallel axis is factored as (dp_replicate, dp_shard), dp_shard inner: dp rank
d = replica * dp_shard + shard rank, so one replica group's shard ranks are adjacent (on one node when it
fits there) and only the replicas' gradient all-reduce crosses nodes. FSDP2 gets the 2-D (replicate,
shard) mesh (`fsdp_mesh`); everyone else still sees "dp", the two flattened.

Adding an axis (torchtitan's `ParallelDims` is the model): a field of `ParallelDims`, its place in
`ORDER`, and, when parameters' gradients are averaged over it, its entry in `GRAD_AXES`: a context
axis makes dense gradients reduce over ("dp", "cp"); an expert axis adds the kind "expert", reduced
over the experts' own data-parallel axis. Parameters carry their kind in their record
(`param_info.GradReduction`), and the reducers ask the mesh for that group (`reduction_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.launch import get_current_device, group_timeout
from meshboost.distributed.param_info import DENSE, EXPERT, grad_reduction

AXES = ("dp", "pp", "tp")
EXPERT_AXES = ("edp", "ep", "pp", "tp")     # the DeviceMesh's dimensions when ep > 1 ("dp" = edp x ep)
HSDP_AXES = ("dp_replicate", "dp_shard")    # the DeviceMesh's dp dimensions when dp_replicate > 1


def check_mesh_shape(world_size: int, tp_size: int, pp_size: int, dp_size: int | None = None,
                     ep_size: int = 1, cp_size: int = 1, dp_replicate: int = 1) -> int:
    """Validate the factors and return dp_size. Pure: raises the same error on every rank."""
    dp_size = _check_dp(world_size, tp_size, pp_size, dp_size, ep_size, cp_size, dp_replicate)
    if dp_size % dp_replicate:
        raise ValueError(f"dp_replicate_size={dp_replicate} does not divide the data-parallel size {dp_size} (world_size="
                         f"{world_size} / (tp_size={tp_size} x pp_size={pp_size} x sp_size={cp_size})): HSDP splits the "
                         f"dp ranks into dp_replicate_size groups that each shard the model; choose a divisor of "
                         f"{dp_size}, or launch a multiple of {tp_size * pp_size * cp_size * dp_replicate} processes")
    if dp_replicate > 1 and ep_size > 1:
        raise NotImplementedError(f"dp_replicate_size={dp_replicate} with ep_size={ep_size}: the data-parallel axis is "
                                  "factored either into HSDP's (replicate, shard) groups or into the experts' (edp, "
                                  "ep), not both yet; use dp_replicate_size=1 with expert parallelism")
    return dp_size


def _check_dp(world_size: int, tp_size: int, pp_size: int, dp_size: int | None, ep_size: int, cp_size: int,
              dp_replicate: int) -> int:
    for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("ep_size", ep_size), ("sp_size", cp_size),
                        ("dp_replicate_size", dp_replicate)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if cp_size > 1:                 # the context ranks sit beside tp: check them first, naming sp_size
        model = tp_size * pp_size * cp_size
        if world_size % model or (dp_size is not None and dp_size * model != world_size):
            raise ValueError(f"world_size={world_size} is not divisible into dp x (pp_size={pp_size} x sp_size="
                             f"{cp_size} x tp_size={tp_size} = {model}); launch a multiple of {model} processes or "
                             "change the sizes")
        dp_size = world_size // model
        if dp_size % ep_size:
            raise ValueError(f"ep_size={ep_size} does not divide the data-parallel size {dp_size}")
        return dp_size
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
    if dp_size % ep_size:
        raise ValueError(
            f"ep_size={ep_size} does not divide the data-parallel size {dp_size} (world_size={world_size} / "
            f"(tp_size={tp_size} * pp_size={pp_size})): expert parallelism splits the experts over data-parallel "
            f"ranks; choose an ep_size dividing {dp_size}, or launch a multiple of {tp_size * pp_size * ep_size} "
            "processes")
    return dp_size


@dataclass(frozen=True)
class ParallelDims:
    """The size of every named axis of the mesh: the one answer to "how large is tp" (plugins, the
    sharder and the records read it from here, through the mesh). Pure: `of_world` validates."""

    dp: int
    pp: int = 1
    tp: int = 1
    ep: int = 1          # experts split over this many of the dp ranks (ep divides dp)
    cp: int = 1          # context parallelism: the sequence split over this many ranks (ColossalAI's sp_size)
    dp_replicate: int = 1   # HSDP: dp = dp_replicate x dp_shard; ZeRO-3 shards inside a replica group

    ORDER = AXES                                  # outermost first; the DeviceMesh's names at ep == 1
    # kind of parameter -> the axes its gradient is averaged over (its data-parallel replicas)
    GRAD_AXES = {DENSE: ("dp",), EXPERT: ("edp",)}

    @classmethod
    def of_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
                 ep: int = 1, cp: int = 1, dp_replicate: int = 1) -> "ParallelDims":
        return cls(dp=check_mesh_shape(world_size, tp, pp, dp, ep, cp, dp_replicate), pp=pp, tp=tp, ep=ep, cp=cp,
                   dp_replicate=dp_replicate)

    @property
    def edp(self) -> int:
        """The replicas of one expert: dp / ep (dp itself without expert parallelism)."""
        return self.dp // self.ep

    @property
    def dp_shard(self) -> int:
        """The ranks of one HSDP replica group, over which ZeRO-3 shards (dp itself without HSDP)."""
        return self.dp // self.dp_replicate

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        """The DeviceMesh's dimension names, outermost first: (dp, pp, tp); dp as (edp, ep) at ep > 1;
        a context axis cp between pp and tp at cp > 1 (its all-to-alls stay near tp's links); dp as
        (dp_replicate, dp_shard) at dp_replicate > 1."""
        dp = ("edp", "ep") if self.ep > 1 else HSDP_AXES if self.dp_replicate > 1 else ("dp",)
        return (*dp, "pp", *(("cp",) if self.cp > 1 else ()), "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in self.mesh_axes)

    def size(self, *axes: str) -> int:
        """The number of ranks along `axes` together (one axis, or several flattened)."""
        out = 1
        for axis in axes:
            if axis not in (*AXES, *EXPERT_AXES, *HSDP_AXES, "cp"):
                raise ValueError(f"axis={axis!r}; expected one of {(*AXES, 'edp', 'ep', 'cp', *HSDP_AXES)}")
            out *= getattr(self, axis)
        return out

    def grad_axes(self, kind: str = DENSE) -> tuple[str, ...]:
        """The axes a `kind` parameter's gradient is averaged over (with context parallelism every weight
        is replicated over the cp ranks too, each of which saw another part of the sequences)."""
        if kind not in self.GRAD_AXES:
            raise ValueError(f"parameter kind {kind!r}; this mesh reduces {sorted(self.GRAD_AXES)}")
        return (*self.GRAD_AXES[kind], "cp") if self.cp > 1 else self.GRAD_AXES[kind]

    def shard_axes(self, kind: str = DENSE) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(replicate axes, shard axes) of a `kind` parameter under ZeRO-3: its gradient axes, with dp
        split into HSDP's replicas and shard ranks at dp_replicate > 1 (no replicate axis otherwise)."""
        axes = self.grad_axes(kind)
        if self.dp_replicate == 1:
            return (), axes
        return ("dp_replicate",), tuple(a for axis in axes for a in (("dp_shard",) if axis == "dp" else (axis,)))


class ParallelMesh:
    """A named (dp, pp, tp) mesh over all ranks of the default process group; `dims` holds the sizes.

    >>> mesh = ParallelMesh(tp_size=2, pp_size=1)   # dp inferred from the world size
    >>> mesh.tp_group, mesh.tp_size, mesh.tp_rank, mesh.device
    """

    def __init__(self, tp_size: int = 1, pp_size: int = 1, dp_size: int | None = None,
                 device_type: str | None = None, ep_size: int = 1, cp_size: int = 1, dp_replicate_size: int = 1):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs an initialised process group: call "
                               "meshboost.launch_from_torch() first")
        current = get_current_device()
        device_type = device_type or current.type
        # Before anything that could differ by rank: ranks with different shapes would build different
        # groups and hang in torch's group creation.
        agree_settings({"tp_size": tp_size, "pp_size": pp_size, "dp_size": dp_size, "device_type": device_type,
                        "ep_size": ep_size, "cp_size": cp_size, "dp_replicate_size": dp_replicate_size},
                       "mesh shape (ParallelMesh arguments)")
        self.world_size = dist.get_world_size()
        self.dims = ParallelDims.of_world(self.world_size, tp=tp_size, pp=pp_size, dp=dp_size, ep=ep_size,
                                          cp=cp_size, dp_replicate=dp_replicate_size)
        # The device every tensor this mesh's collectives touch lives on (launch bound cuda:LOCAL_RANK).
        self.device: torch.device = current if current.type == device_type else torch.device(device_type)
        # Every group inherits the default group's timeout (launch_from_torch(timeout=...)); torch would
        # give new groups its own default instead.
        self.timeout = group_timeout()
        self.device_mesh: DeviceMesh = init_device_mesh(
            device_type, self.dims.shape, mesh_dim_names=self.dims.mesh_axes, **self._timeout_override(device_type))
        self.global_rank = dist.get_rank()
        self._coordinate = dict(zip(self.dims.mesh_axes, self.device_mesh.get_coordinate()))
        if self.dims.ep > 1:          # dp rank = edp rank * ep + ep rank
            self._coordinate["dp"] = self._coordinate["edp"] * self.dims.ep + self._coordinate["ep"]
        elif self.dims.dp_replicate > 1:            # dp rank = replica * dp_shard + shard rank
            self._coordinate["dp"] = self._coordinate["dp_replicate"] * self.dims.dp_shard + self._coordinate["dp_shard"]
            self._coordinate.update(edp=self._coordinate["dp"], ep=0)
        else:
            self._coordinate.update(edp=self._coordinate["dp"], ep=0)
        self._coordinate.setdefault("cp", 0)
        self._coordinate.setdefault("dp_replicate", 0)
        self._coordinate.setdefault("dp_shard", self._coordinate["dp"])
        self._stage_groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self._flattened: dict[tuple[str, ...], DeviceMesh] = {}
        self._reductions: dict[tuple[str, ...], tuple[dist.ProcessGroup, int, int]] = {}

    # -- sizes and coordinates: read from the dims, never stored twice --------------------------
    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def ep_size(self) -> int:
        return self.dims.ep

    @property
    def ep_rank(self) -> int:
        return self._coordinate["ep"]

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self._coordinate["cp"]

    @property
    def edp_rank(self) -> int:
        """This rank's index among the replicas of its experts (its dp rank at ep == 1)."""
        return self._coordinate["edp"]

    @property
    def dp_rank(self) -> int:
        return self._coordinate["dp"]

    @property
    def pp_rank(self) -> int:
        return self._coordinate["pp"]

    @property
    def tp_rank(self) -> int:
        return self._coordinate["tp"]

    def _timeout_override(self, device_type: str) -> dict:
        """DeviceMesh creates its groups with torch's default timeout unless given backend options
        carrying another one; only pass them when the timeout is not torch's default."""
        backend = dist.get_backend()
        default = default_pg_timeout if backend == "gloo" else default_pg_nccl_timeout
        if self.timeout is None or backend not in ("gloo", "nccl") or self.timeout == default:
            return {}
        options = dist.ProcessGroupGloo._Options() if backend == "gloo" else dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        return {"backend_override": {axis: (backend, options) for axis in self.dims.mesh_axes}}

    # -- groups -------------------------------------------------------------------------------
    def group(self, *axes: str) -> dist.ProcessGroup:
        """The process group along `axes` ("dp", "pp", "tp"; "edp" and "ep" with expert parallelism, edp
        being dp without it); several: flattened into one group, built on the first call, which every rank must
        make) that contains this rank."""
        return self.submesh(*axes).get_group()

    def submesh(self, *axes: str) -> DeviceMesh:
        """The one-dimensional DeviceMesh along `axes` through this rank (several axes: flattened into
        one dimension, as FSDP2 and DTensor want a data-parallel mesh)."""
        for axis in axes:
            self.dims.size(axis)                      # raises on an unknown axis
        names = self.dims.mesh_axes
        if self.dims.ep > 1:                          # dp is (edp, ep) flattened
            axes = tuple(a for axis in axes for a in (("edp", "ep") if axis == "dp" else (axis,)))
        elif self.dims.dp_replicate > 1:              # dp (and edp, the same ranks) is (dp_replicate, dp_shard)
            axes = tuple(dict.fromkeys(a for axis in axes for a in (HSDP_AXES if axis in ("dp", "edp") else (axis,))))
            if "ep" in axes:
                raise ValueError("the ep axis has one rank at ep_size=1 (no expert parallelism): ask for the "
                                 "axes without it")
        else:
            if "dp_replicate" in axes:
                raise ValueError("the dp_replicate axis has one rank at dp_replicate_size=1 (no HSDP): ask for the "
                                 "axes without it")
            axes = tuple("dp" if axis == "dp_shard" else axis for axis in axes)
            if "ep" in axes:
                raise ValueError("the ep axis has one rank at ep_size=1 (no expert parallelism): ask for the "
                                 "axes without it")
            axes = tuple(dict.fromkeys("dp" if axis == "edp" else axis for axis in axes))
        if self.dims.cp == 1:
            if axes == ("cp",):
                raise ValueError("the cp axis has one rank at sp_size=1 (no context parallelism): ask for the "
                                 "axes without it")
            axes = tuple(axis for axis in axes if axis != "cp")
        if len(axes) == 1:
            return self.device_mesh[axes[0]]
        axes = tuple(a for a in names if a in axes)   # the mesh's order
        if axes not in self._flattened:
            override = self._timeout_override(self.device_mesh.device_type).get("backend_override", {})
            self._flattened[axes] = self.device_mesh[axes]._flatten("_".join(axes),
                                                                    backend_override=override.get(axes[0]))
        return self._flattened[axes]

    def fsdp_mesh(self, kind: str = DENSE) -> DeviceMesh:
        """The DeviceMesh FSDP2 shards a `kind` parameter over: its gradient axes flattened into one
        dimension, or at dp_replicate > 1 the 2-D (replicate, shard) mesh of HSDP (the shard axes
        flattened into one: dp_shard, with cp when there is a context axis)."""
        replicate, shard = self.dims.shard_axes(kind)
        if not replicate:
            return self.submesh(*shard)
        if len(shard) == 1:
            return self.device_mesh[(*replicate, *shard)]
        # torch deprecates slicing a flattened dimension from the root mesh: join the two 1-D meshes instead
        return DeviceMesh._concatenate([self.submesh(*replicate), self.submesh(*shard)])

    # -- who reduces what: the parameter's record, answered here ---------------------------------
    def reduction_axes(self, param: torch.Tensor) -> tuple[str, ...]:
        """The axes `param`'s gradient is averaged over: its record's kind (`param_info.GradReduction`),
        dense when it has none."""
        record = grad_reduction(param)
        return self.dims.grad_axes(record.kind if record is not None else DENSE)

    def reduction_of(self, params) -> tuple[tuple[str, ...], dist.ProcessGroup, int, int]:
        """(axes, group, size, this rank's index in it) that averages the gradients of `params`, which
        must all be reduced over the same axes (a reducer handles one group; raises naming the two)."""
        found: dict[tuple[str, ...], torch.Tensor] = {}
        for p in params:
            found.setdefault(self.reduction_axes(p), p)
        if len(found) > 1:
            described = ", ".join(f"{tuple(p.shape)} over {axes}" for axes, p in found.items())
            raise NotImplementedError(f"one gradient reducer was handed parameters averaged over different mesh "
                                      f"axes ({described}); give each group of axes its own reducer")
        axes = next(iter(found), self.dims.grad_axes(DENSE))
        return (axes, *self._reduction(axes))

    def reduction_rank(self, param: torch.Tensor) -> int:
        """This rank's index in the group averaging `param`'s gradient (0: it counts a replicated
        gradient in the norm)."""
        return self._reduction(self.reduction_axes(param))[2]

    def _reduction(self, axes: tuple[str, ...]) -> tuple[dist.ProcessGroup, int, int]:
        if axes not in self._reductions:
            group = self.group(*axes)
            self._reductions[axes] = (group, self.dims.size(*axes), dist.get_rank(group))
        return self._reductions[axes]

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
            # (edp, ep) -> dp, (cp, tp) -> one index: a group per (dp, cp, tp) coordinate
            grid = self.device_mesh.mesh.reshape(self.dp_size, self.pp_size, self.dims.cp * self.tp_size)
            for d in range(self.dp_size):
                for t in range(self.dims.cp * self.tp_size):
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

    def size(self, *axes: str) -> int:
        return self.dims.size(*axes)

    def coordinate(self, axis: str) -> int:
        self.dims.size(axis)
        return self._coordinate[axis]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        ep = f", ep={self.ep_size}" if self.ep_size > 1 else ""
        return (f"ParallelMesh(dp={self.dp_size}{ep}, pp={self.pp_size}, tp={self.tp_size}; rank "
                f"{self.global_rank} at dp={self.dp_rank}, pp={self.pp_rank}, tp={self.tp_rank}; {self.device})")
