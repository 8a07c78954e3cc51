"""ParallelDims: the one answer to "how large is each axis" of the parallel layout, which axes average a
parameter's gradient over its replicas and which shard it (ZeRO-3), and the validation of a world's
factorisation (`check_mesh_shape`). Pure: no process group; `ParallelMesh` (mesh.py) builds the groups
from one, and the planner reads the same record.

Axis order is (dp, pp, tp) with tp innermost, so the ranks of one tensor-parallel group are
adjacent (on one node when tp <= GPUs per node) and its all-reduces stay on the fastest links. With
expert parallelism (ep > 1) the data-parallel axis is factored as (edp, ep), ep inner: dp rank
d = edp_rank * ep + ep_rank. The ep ranks of one (pp, tp) coordinate split the experts and exchange
tokens; the edp ranks hold the same experts (the experts' own data-parallel replicas); "dp" is the
two flattened, over which dense weights are averaged as before. With hybrid sharding (HSDP,
dp_replicate > 1) the data-parallel axis is factored as (dp_replicate, dp_shard), dp_shard inner: dp rank
d = replica * dp_shard + shard rank, so one replica group's shard ranks are adjacent (on one node when it
fits there) and only the replicas' gradient all-reduce crosses nodes. FSDP2 gets the 2-D (replicate,
shard) mesh (`fsdp_mesh`); everyone else still sees "dp", the two flattened. Both (HSDP with ep, as
torchtitan lays it out): ep borrows from dp_shard, so dp is (dp_replicate, edp_shard, ep), dp_shard =
edp_shard x ep shards the dense weights inside a replica group, edp = dp_replicate x edp_shard holds
the same experts and edp_shard shards them.

Adding an axis (torchtitan's `ParallelDims` is the model): a field of `ParallelDims`, its place in
`ORDER`, and, when parameters' gradients are averaged over it, its entry in `GRAD_AXES`: a context
axis makes dense gradients reduce over ("dp", "cp"); an expert axis adds the kind "expert", reduced
over the experts' own data-parallel axis. Parameters carry their kind in their record
(`param_info.GradReduction`), and the reducers ask the mesh for that group (`reduction_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from meshboost.distributed.param_info import DENSE, EXPERT

AXES = ("dp", "pp", "tp")
EXPERT_AXES = ("edp", "ep", "pp", "tp")     # the DeviceMesh's dimensions when ep > 1 ("dp" = edp x ep)
HSDP_AXES = ("dp_replicate", "dp_shard")    # the DeviceMesh's dp dimensions when dp_replicate > 1
HSDP_EXPERT_AXES = ("dp_replicate", "edp_shard", "ep")  # ... and with ep > 1 too (dp_shard = edp_shard x ep)


def check_mesh_shape(world_size: int, tp_size: int, pp_size: int, dp_size: int | None = None,
                     ep_size: int = 1, cp_size: int = 1, dp_replicate: int = 1) -> int:
    """Validate the factors and return dp_size. Pure: raises the same error on every rank."""
    dp_size = _check_dp(world_size, tp_size, pp_size, dp_size, ep_size, cp_size, dp_replicate)
    if dp_size % dp_replicate:
        raise ValueError(f"dp_replicate_size={dp_replicate} does not divide the data-parallel size {dp_size} (world_size="
                         f"{world_size} / (tp_size={tp_size} x pp_size={pp_size} x cp_size={cp_size})): HSDP splits the "
                         f"dp ranks into dp_replicate_size groups that each shard the model; choose a divisor of "
                         f"{dp_size}, or launch a multiple of {tp_size * pp_size * cp_size * dp_replicate} processes")
    if dp_replicate > 1 and ep_size > 1 and (dp_size // ep_size) % dp_replicate:
        # torchtitan's layout: ep borrows its ranks from inside one replica group (dp_shard), so each replica
        # group holds every expert once and the replicas of one expert (edp) split into the same groups
        raise ValueError(f"dp_replicate_size={dp_replicate} does not divide the experts' data-parallel size "
                         f"{dp_size // ep_size} (edp = dp {dp_size} / ep_size={ep_size}): HSDP with expert "
                         f"parallelism puts the ep ranks inside one replica group of dp / dp_replicate_size ranks; "
                         f"choose a dp_replicate_size dividing {dp_size // ep_size}, or an ep_size dividing "
                         f"{dp_size // dp_replicate}")
    return dp_size


def _check_dp(world_size: int, tp_size: int, pp_size: int, dp_size: int | None, ep_size: int, cp_size: int,
              dp_replicate: int) -> int:
    check_degrees(tp=tp_size, pp=pp_size, ep=ep_size, cp=cp_size, dp_replicate=dp_replicate)
    if cp_size > 1:                 # the context ranks sit beside tp: check them first, naming cp_size
        model = tp_size * pp_size * cp_size
        if world_size % model or (dp_size is not None and dp_size * model != world_size):
            raise ValueError(f"world_size={world_size} is not divisible into dp x (pp_size={pp_size} x cp_size="
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


def check_degrees(**degrees) -> None:
    """Each axis degree (tp=, pp=, ep=, cp=, dp_replicate=) a positive integer, named as the keyword users
    write (tp_size=...; cp_size is ColossalAI's sp_size). Pure: the same error on every rank."""
    for axis, value in degrees.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{axis}_size={value!r} must be a positive integer"
                             + (" (cp_size: ColossalAI's sp_size)" if axis == "cp" else ""))


@dataclass(frozen=True)
class ParallelDims:
    """The parallel layout's one record: the size of every named axis and the context-parallel mode. The
    one answer to "how large is tp" (the plugin's config holds one, the mesh is built from one, the
    sharder and the records read it through the mesh). Pure: each instance checks its degrees when
    built; `dp=None` means "the rest of the world" until `resolved(world_size)` (the mesh) fixes it."""

    dp: int | None = None
    pp: int = 1
    tp: int = 1
    ep: int = 1          # experts split over this many of the dp ranks (ep divides dp)
    cp: int = 1          # context parallelism: the sequence split over this many ranks (ColossalAI's sp_size)
    dp_replicate: int = 1   # HSDP: dp = dp_replicate x dp_shard; ZeRO-3 shards inside a replica group
    # how the cp ranks attend (shardformer/context_checks.py names and checks the modes; None at cp == 1)
    cp_mode: str | None = None

    ORDER = AXES                                  # outermost first; the DeviceMesh's names at ep == 1
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

    @classmethod
    def of_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
                 ep: int = 1, cp: int = 1, dp_replicate: int = 1, cp_mode: str | None = None) -> "ParallelDims":
        return cls(dp=check_mesh_shape(world_size, tp, pp, dp, ep, cp, dp_replicate), pp=pp, tp=tp, ep=ep, cp=cp,
                   dp_replicate=dp_replicate, cp_mode=cp_mode)

    def resolved(self, world_size: int) -> "ParallelDims":
        """These dims over a world of `world_size` ranks, dp computed (or checked when given): the
        factorisation's one validation (`check_mesh_shape`)."""
        return self.of_world(world_size, tp=self.tp, pp=self.pp, dp=self.dp, ep=self.ep, cp=self.cp,
                             dp_replicate=self.dp_replicate, cp_mode=self.cp_mode)

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
    def mesh_axes(self) -> tuple[str, ...]:
        """The DeviceMesh's dimension names, outermost first: (dp, pp, tp); dp as (edp, ep) at ep > 1;
        a context axis cp between pp and tp at cp > 1 (its all-to-alls stay near tp's links); dp as
        (dp_replicate, dp_shard) at dp_replicate > 1; both: (dp_replicate, edp_shard, ep)."""
        hsdp = HSDP_EXPERT_AXES if self.ep > 1 else HSDP_AXES
        dp = hsdp if self.dp_replicate > 1 else ("edp", "ep") if self.ep > 1 else ("dp",)
        return (*dp, "pp", *(("cp",) if self.cp > 1 else ()), "tp")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.size(axis) for axis in self.mesh_axes)

    def size(self, *axes: str) -> int:
        """The number of ranks along `axes` together (one axis, or several flattened)."""
        out = 1
        for axis in axes:
            if axis not in (*AXES, *EXPERT_AXES, *HSDP_EXPERT_AXES, "dp_shard", "cp"):
                raise ValueError(f"axis={axis!r}; expected one of {(*AXES, 'edp', 'ep', 'cp', *HSDP_AXES, 'edp_shard')}")
            out *= self._dp() if axis == "dp" else getattr(self, axis)
        return out

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
