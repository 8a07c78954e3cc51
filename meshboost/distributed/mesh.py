"""ParallelMesh: the process-group mesh over named axes, built once and passed down.

Owns: building the process groups of one `ParallelDims` through torch's DeviceMesh on the dims' own rank
grid, with the default group's timeout (one axis, or several flattened into one group); agreeing that
every rank asks for the same mesh (and, for plugins, the same settings: `agree_settings`); answering
"which group / size / coordinate" for each logical axis, the device this rank computes on, and the
groups joining pipeline stages (weights tied across them). Must not restate the layout algebra: which
mesh dimensions stand behind an axis, the factorisation's check and the coordinates are dims.py's.
Must not hold module-level state: two meshes can coexist in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh

from meshboost.distributed.agreement import agree_settings
from meshboost.distributed.dims import ParallelDims
from meshboost.distributed.launch import get_current_device, group_timeout
from meshboost.distributed.param_info import DENSE, grad_reduction

class ParallelMesh:
    """The process-group mesh of one `ParallelDims` over all ranks of the default process group.

    >>> mesh = ParallelMesh(ParallelDims(tp=2))     # dp inferred from the world size
    >>> mesh = ParallelMesh(config.dims)             # a plugin's layout (HybridParallelConfig.dims)
    >>> mesh.tp_group, mesh.tp_size, mesh.tp_rank, mesh.device
    """

    def __init__(self, dims: ParallelDims | None = None, device_type: str | None = None):
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh needs an initialised process group: call "
                               "meshboost.launch_from_torch() first")
        if dims is not None and not isinstance(dims, ParallelDims):
            raise TypeError(f"ParallelMesh(dims={dims!r}): pass the layout as one record, e.g. "
                            "ParallelMesh(ParallelDims(tp=2, pp=2)); no dims means plain data parallelism")
        dims = ParallelDims() if dims is None else dims
        current = get_current_device()
        device_type = device_type or current.type
        # Before anything that could differ by rank: ranks with different shapes would build different
        # groups and hang in torch's group creation.
        agree_settings({"dims": dims, "device_type": device_type}, "mesh shape (ParallelMesh arguments)")
        self.world_size = dist.get_world_size()
        # the factorisation's one check (dims.py), the same error on every rank
        self.dims = dims.resolved(self.world_size)
        # The device every tensor this mesh's collectives touch lives on (launch bound cuda:LOCAL_RANK).
        self.device: torch.device = current if current.type == device_type else torch.device(device_type)
        # Every group inherits the default group's timeout (launch_from_torch(timeout=...)); torch would
        # give new groups its own default instead.
        self.timeout = group_timeout()
        override = self._timeout_override(device_type)
        # the dims' own rank grid: the planner reads its groups from the same one
        self.device_mesh: DeviceMesh = DeviceMesh(
            device_type, self.dims.rank_grid(), mesh_dim_names=self.dims.mesh_axes,
            backend_override=tuple(override[axis] for axis in self.dims.mesh_axes) if override else None)
        self.global_rank = dist.get_rank()
        self._coordinate = self.dims.coordinates(self.global_rank)
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
        """{mesh dimension: (backend, options)}: DeviceMesh creates its groups with torch's default timeout
        unless given backend options carrying another one; only pass them when the timeout is not torch's
        default (empty then)."""
        backend = dist.get_backend()
        default = default_pg_timeout if backend == "gloo" else default_pg_nccl_timeout
        if self.timeout is None or backend not in ("gloo", "nccl") or self.timeout == default:
            return {}
        options = dist.ProcessGroupGloo._Options() if backend == "gloo" else dist.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        return {axis: (backend, options) for axis in self.dims.mesh_axes}

    # -- groups -------------------------------------------------------------------------------
    def group(self, *axes: str) -> dist.ProcessGroup:
        """The process group along `axes` ("dp", "pp", "tp"; "edp" and "ep" with expert parallelism, edp
        being dp without it); several: flattened into one group, built on the first call, which every rank must
        make) that contains this rank."""
        return self.submesh(*axes).get_group()

    def submesh(self, *axes: str) -> DeviceMesh:
        """The one-dimensional DeviceMesh along the logical `axes` through this rank (several axes, or one
        standing for several mesh dimensions: flattened into one dimension, as FSDP2 and DTensor want a
        data-parallel mesh). The dims map the axes to mesh dimensions (`ParallelDims.mesh_dims`)."""
        dims = self.dims.mesh_dims(*axes)
        if not dims:
            raise ValueError(f"the {'/'.join(axes)} axis has one rank in this layout ({self.dims}) and no mesh "
                             "dimension: ask for the axes without it")
        if len(dims) == 1:
            return self.device_mesh[dims[0]]
        if dims not in self._flattened:
            override = self._timeout_override(self.device_mesh.device_type)
            self._flattened[dims] = self.device_mesh[dims]._flatten("_".join(dims),
                                                                    backend_override=override.get(dims[0]))
        return self._flattened[dims]

    def fsdp_mesh(self, kind: str = DENSE, axes: tuple[str, ...] | None = None) -> DeviceMesh:
        """The DeviceMesh FSDP2 shards a `kind` parameter (or one averaged over gradient `axes`) over: its
        gradient axes flattened into one dimension, or at dp_replicate > 1 the 2-D (replicate, shard) mesh
        of HSDP (the shard axes flattened into one: dp_shard, with cp when there is a context axis;
        edp_shard for the experts at ep > 1, dp_shard = edp_shard x ep for the dense weights)."""
        replicate, shard = self.dims.split_axes(self.dims.grad_axes(kind) if axes is None else axes)
        if not replicate:
            return self.submesh(*shard)
        replicate_dims, shard_dims = self.dims.mesh_dims(*replicate), self.dims.mesh_dims(*shard)
        if len(shard_dims) == 1:
            return self.device_mesh[(*replicate_dims, *shard_dims)]
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
            for column in self.dims.groups("pp"):        # one pipeline per (dp, cp, tp) coordinate
                ranks = [column[p] for p in pp_ranks]
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
        """This rank's index along the logical `axis` (`ParallelDims.coordinates`)."""
        self.dims.mesh_dims(axis)                   # raises on an unknown axis
        return self._coordinate[axis]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        """Every axis beyond size 1 and each axis' mode: cp's (`cp=2(ring_attn)`) and tp's, Megatron sequence
        parallelism (`tp=2(sp)`), then this rank's coordinates."""
        dims = self.dims
        dp = "".join(f", {name}={n}" for name, n in (("ep", dims.ep), ("dp_replicate", dims.dp_replicate)) if n > 1)
        cp = f", cp={dims.cp}({dims.cp_mode})" if dims.cp > 1 else ""
        tp = f"tp={dims.tp}" + ("(sp)" if dims.sequence_parallel else "")
        at = f", cp={self.cp_rank}" if dims.cp > 1 else ""
        return (f"ParallelMesh(dp={dims.dp}{dp}, pp={dims.pp}{cp}, {tp}; rank {self.global_rank} at "
                f"dp={self.dp_rank}, pp={self.pp_rank}{at}, tp={self.tp_rank}; {self.device})")
