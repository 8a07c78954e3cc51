"""FSDPOptimizer: the boosted optimizer of the FSDP2 engine (GeminiPlugin, TorchFSDPPlugin, and
HybridParallelPlugin with zero_stage=3 use it).

Owns: where state lives under torch FSDP2. The user's optimizer steps FSDP2's sharded parameters
directly (DTensors holding 1/dp of every weight, kept in fp32: they are the master weights, FSDP2
casts them for compute), so its moments are sharded alike. The step order is
MixedPrecisionOptimizer's (fp16 loss scale, overflow agreed over every rank, the one global-norm
routine over the local shards, which are disjoint), and the state is exported and imported per
parameter in the one format of `meshboost.optim.state`: full tensors, gathered one parameter at a
time and cut back into any layout, so a checkpoint loads into any plugin at any size.
Must not shard or reduce anything itself: FSDP2 does.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from meshboost.optim import MixedPrecisionOptimizer, counted_here
from meshboost.optim import state as fmt


def full_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole of DTensor `t` on every rank of its mesh (a collective: every rank calls it); the
    shard is moved to the mesh's `device` first (offloaded shards live on the CPU)."""
    with torch.no_grad():
        t = t.detach()
        if t.device != device:
            t = t.to(device)
        return t.full_tensor()


def local_piece(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's piece of `full` in the layout of `like` (no communication: each rank cuts its own)."""
    mesh = like.device_mesh
    return distribute_tensor(full.to(mesh.device_type), mesh, like.placements, src_data_rank=None).to_local()


def first_replica(t: DTensor) -> bool:
    """True on the first rank of every mesh dimension `t` is replicated over (HSDP's replica groups
    hold the same shards: only the first counts them in the norm, so each piece is counted once)."""
    return all(t.device_mesh.get_local_rank(dim) == 0 for dim, placement in enumerate(t.placements)
               if placement.is_replicate())


class FSDPOptimizer(MixedPrecisionOptimizer):
    """The user's `optim`, whose param groups hold the FSDP2 sharded parameters, stepped with
    MixedPrecisionOptimizer's order, with its `PrecisionConfig` (whose precision is FSDP2's
    compute dtype; the stepped weights are fp32 in every case)."""

    dp_partitioned = True       # each rank holds a disjoint shard of every gradient: each counts its own
    _gathers_state = True       # exported state comes back freshly gathered

    @property
    def keeps_masters(self) -> bool:
        return True             # the fp32 shards: a model save gathers them (every rank joins)

    def _build_masters(self) -> None:
        self.master_of = {p: p for params in self._working for p in params}

    @torch.no_grad()
    def _master_grads(self) -> list[tuple[torch.Tensor, bool]]:
        """This rank's shard of every gradient (FSDP2 reduce-scattered and averaged them over dp). Who
        counts it in the norm is `counted_here`'s rule: a dp shard (a DTensor) on every dp rank (under
        HSDP on the first replica group's only: `first_replica`), an
        ignored module's whole parameter on dp rank 0 only; under tensor parallelism (the parameter's
        record, HybridParallelPlugin zero_stage=3) a tp shard on every tp rank and a weight replicated
        over tp on tp rank 0 only."""
        out = []
        for params in self._working:
            for p in params:
                if p.grad is None:
                    continue
                sharded = isinstance(p.grad, DTensor)
                counted = counted_here(p, self.mesh, sharded) and (not sharded or first_replica(p.grad))
                out.append((p.grad.to_local() if sharded else p.grad, counted))
        return out

    def grad_bytes(self) -> int:
        return 0                # gradients are the parameters' .grad: counted with them

    # -- state by parameter: full tensors, one parameter at a time ----------------------------------
    def master_weight(self, param: torch.Tensor) -> torch.Tensor | None:
        """The whole fp32 weight (a collective over every rank: each calls it for the same params)."""
        return full_tensor(param, self.mesh.device) if isinstance(param, DTensor) else None

    def _local_state(self, param: torch.Tensor, replica0_only: bool = False) -> tuple[dict, torch.Tensor | None]:
        state = self.optim.state.get(param, {})
        whole = {k: full_tensor(v, self.mesh.device) if isinstance(v, DTensor) else v
                 for k, v in sorted(state.items())}
        return whole, self.master_weight(param)

    def _import_param(self, param: torch.Tensor, state: dict, master: torch.Tensor | None) -> None:
        """`state` and `master` arrive whole (a DTensor's `shape` is its full shape); keep this rank's piece."""
        if not isinstance(param, DTensor):
            super()._import_param(param, state, master)
            return
        if master is not None:
            param.to_local().copy_(local_piece(master, param))
        own = {}
        for k, v in state.items():
            if fmt.is_per_element(v, param):
                own[k] = torch.zeros_like(param, dtype=v.dtype)     # a DTensor laid out like the parameter
                own[k].to_local().copy_(local_piece(v, param))
            else:
                own[k] = v                                          # Adam's step stays where it was saved
        self.optim.state[param] = own
