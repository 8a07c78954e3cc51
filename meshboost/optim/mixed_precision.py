"""MixedPrecisionOptimizer: fp32 master weights, loss scaling, overflow skip and clipping.

Owns the order of one optimizer step, written once for every wrapper (ZeroOptimizer only changes
where master weights and their gradients live):

    backward:  loss * scale -> autograd                    (fp16 only: keeps small grads representable)
    step:      checks before the update                    (`check_before_update`: a verdict every
                                                           rank shares, e.g. "the global batch held
                                                           a labelled token"; one that raises drops
                                                           the grads, the weights stay unchanged)
               grads -> fp32 master grads                  (ZeRO: reduce-scatter over dp first, and
                                                           the checks below read the reduced shards)
               found_inf = any inf/nan, all-reduce MAX over the world group of the mesh
                                                           (every rank of the step agrees, so
                                                           replicas never diverge)
               overflow -> skip: zero grads, back off the scale, norm = None
               norm = global norm / scale                  (grad_norm.py, the one implementation; only
                                                           when clipping (max_norm > 0) or tracking
                                                           (track_grad_norm): a pass over the grads and
                                                           an all-reduce the step otherwise skips)
               master grads *= clip_coef / scale           (unscale and clip in one pass; ZeRO makes
                                                           the fp32 copy here, on the CPU if offloaded)
               inner optimizer step on the fp32 masters
               masters -> working weights                  (copy, or all-gather under ZeRO)

The user's optimizer object is kept and its param groups are pointed at the masters, so an LR
scheduler built on it keeps working and `optimizer.param_groups` is the real thing. Its state is
exported and imported per parameter in the one format of `state.py` (`state_dict` included). An
optimizer that already stepped keeps its state (ColossalAI allows boosting it): each parameter's
moments, still full-size from before sharding, are cut to this rank's layout and installed on its
master (ZeRO: into its partitions) by the same per-parameter import a checkpoint load uses, so the
next steps are the ones the unboosted optimizer would take.
Must not contain data-parallel partitioning (that is zero.py) or norm maths (grad_norm.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from meshboost.distributed import comm
from meshboost.distributed.param_info import full_shape
from meshboost.optim import state as fmt
from meshboost.optim.grad_norm import clip_coefficient, counted_here, global_grad_norm
from meshboost.optim.grad_scaler import DynamicGradScaler
from meshboost.optim.precision import PrecisionConfig, precision_config
from meshboost.optim.step_requests import StepRequests
from meshboost.optim.wrapper import OptimizerWrapper

logger = logging.getLogger("meshboost.optim")


def _copy_into_master(master: torch.Tensor, value: torch.Tensor | None, like: torch.Tensor) -> None:
    """master <- value (fp32); a meta master is first given storage on `like`'s device."""
    if master.is_meta:
        attrs = dict(master.__dict__)
        torch.utils.swap_tensors(master, torch.nn.Parameter(torch.zeros(master.shape, dtype=master.dtype,
                                                                        device=like.device)))
        master.__dict__.update(attrs)
    if value is not None:
        master.copy_(value)


class MixedPrecisionOptimizer(StepRequests, OptimizerWrapper):
    """Wrap `optim` (built on the model's parameters) for training with `precision` working weights.

    mesh: the `ParallelMesh` (overflow and norms are agreed over its world group, on its device).
    config: the `PrecisionConfig` (working precision, clipping, the fp16 `GradScalerConfig`; defaults
    when None), read through this object, never copied into fields. verbose: global rank 0 logs each
    skipped step and the new loss scale (logger "meshboost.optim", level INFO).
    track_grad_norm: compute the global gradient norm on every step even without clipping, so
    `get_grad_norm()` returns it (with max_norm > 0 it is computed anyway: clipping needs it). It is
    also the attribute `optimizer.track_grad_norm`, which may be switched on after `boost`, on every
    rank alike (the norm is an all-reduce over the world group: a rank-local switch would hang).

    Build it while the parameters are still fp32 (before casting the model) so the masters start
    from the exact fp32 weights.
    """

    dp_partitioned = False      # gradients are replicated over dp (DDP): dp rank 0 counts them
    _update_checks: tuple = ()  # check_before_update's callables, run first in every step()
    _step_reductions: tuple = ()  # average_at_step's (params, group) pairs

    def __init__(self, optim: Optimizer, mesh, config: PrecisionConfig | None = None, *, verbose: bool = False,
                 track_grad_norm: bool = False):
        super().__init__(optim)
        self.verbose, self.track_grad_norm = bool(verbose), bool(track_grad_norm)
        self.config = precision_config(config)
        self.mesh, self.working_dtype = mesh, self.config.dtype
        self.scaler = DynamicGradScaler(self.config.scaler) if self.config.precision == "fp16" else None
        self._grad_norm: float | None = None
        self._norm_untracked = False      # the last step ran without computing the norm (get_grad_norm warns)
        self._grad_sync = True
        self._scaled_backward = False     # did this step's gradients come through backward() (fp16 check)
        self._working = [[p for p in g["params"] if p.requires_grad] for g in optim.param_groups]
        carried, problem = self._take_state()    # an optimizer that already stepped: its state, before masters exist
        self._build_masters()
        self._agree_carry(problem or (self._check_carried(carried) if carried else None))
        self._carry_state(carried)

    # the step's numerics, read from the one config
    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def max_norm(self) -> float:
        return float(self.config.max_norm)

    @property
    def norm_type(self) -> float:
        return self.config.norm_type

    @property
    def working_param_groups(self) -> list[list[torch.Tensor]]:
        return self._working

    @property
    def keeps_masters(self) -> bool:
        return self.working_dtype != torch.float32

    # -- layout hooks (ZeroOptimizer overrides these) ------------------------------------------
    def _build_masters(self) -> None:
        """One fp32 master per working parameter (the parameter itself in fp32), swapped into the
        user's param groups."""
        self.master_of: dict[torch.Tensor, torch.Tensor] = {}
        for group, params in zip(self.optim.param_groups, self._working):
            masters = []
            for p in params:
                m = p if self.working_dtype == torch.float32 else torch.nn.Parameter(p.detach().float().clone())
                self.master_of[p] = m
                masters.append(m)
            group["params"] = masters

    def _master_grads(self) -> list[tuple[torch.Tensor, bool]]:
        """Fill master grads from the working grads; return [(grad, counted_in_norm_here)], the
        tensors the overflow check and the norm read."""
        out = []
        for params in self._working:
            for p in params:
                m = self.master_of[p]
                if p.grad is None:
                    m.grad = None
                    continue
                if m is not p:
                    m.grad = p.grad.detach().float()
                out.append((m.grad, counted_here(p, self.mesh, self.dp_partitioned)))
        return out

    def _unscale_and_clip(self, grads: list[tuple[torch.Tensor, bool]], factor: float) -> None:
        """Master grads *= factor (1/scale times the clip coefficient), one pass; `grads` are what
        `_master_grads` returned (here the master grads themselves)."""
        if factor != 1.0:
            for g, _ in grads:
                g.mul_(factor)

    def _write_back(self) -> None:
        """Copy updated masters into the working weights."""
        with torch.no_grad():
            for p, m in self.master_of.items():
                if m is not p:
                    p.copy_(m)

    @torch.no_grad()
    def sync_masters_from_model(self) -> None:
        """Refresh fp32 masters from the working weights (after the model was loaded in place), so the
        next step does not overwrite the loaded weights with stale masters. Masters still on the
        meta device (a model boosted on meta, then loaded) get real storage here."""
        for p, m in self.master_of.items():
            if m is not p:
                _copy_into_master(m, p.detach(), p)

    def _release_grads(self) -> None:
        self._scaled_backward = False
        for p, m in self.master_of.items():
            p.grad = None
            m.grad = None

    def _clear_master_grads(self) -> None:
        """fp32 master grads are transient; working grads stay until zero_grad (torch's habit)."""
        for p, m in self.master_of.items():
            if m is not p:
                m.grad = None

    # -- the state of an optimizer that stepped before boost ---------------------------------------
    def _take_state(self) -> tuple[dict[torch.Tensor, dict], str | None]:
        """The user's state per trained parameter (moments full-size: sharding slices the weights in
        place, never the state), removed from the optimizer ({} for a fresh optimizer), and what makes
        it impossible to carry (None: nothing)."""
        state, carried, problem = self.optim.state, {}, None
        for params in self._working:
            for p in params:
                if p not in state or not state[p]:
                    continue
                want = full_shape(p)
                for k, v in state[p].items():
                    if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != want:
                        problem = problem or (
                            f"the optimizer already stepped: its state {k!r} of a parameter of shape {want} has "
                            f"shape {tuple(v.shape)}, neither the parameter's nor a scalar; boost the optimizer "
                            "before its first step")
                carried[p] = dict(state[p])
        state.clear()                         # what is not carried (untrained parameters) is never stepped again
        return carried, problem

    def _agree_carry(self, problem: str | None) -> None:
        """Raise on every rank when any rank cannot carry its optimizer's state: pipeline stages hold
        different parameters, so one stage may refuse alone, and the others would wait for it in their
        next collective. One all-reduce of a flag per rank over the world group, at boost."""
        failed = [0] if problem else []
        if dist.is_initialized():
            group = self.mesh.world_group
            flags = torch.zeros(dist.get_world_size(group), device=self.mesh.device)
            flags[dist.get_rank(group)] = float(problem is not None)
            comm.all_reduce(flags, group)
            failed = flags.nonzero().flatten().tolist()
        if problem:
            raise ValueError(problem)
        if failed:
            raise ValueError(f"rank(s) {failed} cannot carry the state of the optimizer, which already stepped (their "
                             "error says why and names the fix), so boost fails on every rank")

    @torch.no_grad()
    def _carry_state(self, carried: dict[torch.Tensor, dict]) -> None:
        """Install the carried state on the masters (this rank's tp part of each moment; scalars as
        they are), as a checkpoint load would; the masters keep the weights' values."""
        for p, state in carried.items():
            local = {k: fmt.local_part(v, p, f"optimizer state {k!r}") if torch.is_tensor(v) and v.dim() > 0 else v
                     for k, v in state.items()}
            self._import_param(p, local, None)

    def _check_carried(self, carried: dict[torch.Tensor, dict]) -> str | None:
        """Why the carried state cannot be kept exactly (ZeroOptimizer: one state per bucket), or None."""
        return None

    # -- state by parameter (optim/state.py) ----------------------------------------------------
    def master_weight(self, param: torch.Tensor) -> torch.Tensor | None:
        m = self.master_of.get(param)
        return None if m is None or m is param else m.detach()

    def _dp_rank(self) -> int:
        # replica 0 of the experts: the ep ranks of dp replica 0 hold the other experts, and join the gathers
        return self.mesh.edp_rank

    def _local_state(self, param: torch.Tensor, replica0_only: bool = False) -> tuple[dict, torch.Tensor | None]:
        m = self.master_of[param]
        return self.optim.state.get(m, {}), (None if m is param else m.detach())

    def _import_param(self, param: torch.Tensor, state: dict, master: torch.Tensor | None) -> None:
        m = self.master_of[param]
        if m is not param:
            _copy_into_master(m, master if master is not None else param.detach(), param)
        self.optim.state[m] = {k: fmt.to_device(v, m.device) for k, v in state.items()}

    def _after_import(self) -> None:
        self._write_back()

    def state_dict(self) -> dict:
        """Every parameter's state as full tensors keyed by position, with the param groups and the
        loss scaler (the format of `meshboost.optim.state`). A collective when tp/dp shard the state:
        call it on every rank."""
        keys = self._positions()
        return {"state": dict(self.export_state(keys)), **self.export_meta(keys)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a `state_dict()` of a meshboost optimizer over the same parameters (any layout)."""
        if not isinstance(state_dict, dict) or state_dict.get("format") != fmt.FORMAT:
            raise ValueError("load_state_dict needs a meshboost optimizer state_dict (format "
                             f"{fmt.FORMAT!r}); torch optimizer state dicts are keyed by position of the fp32 "
                             "masters and cannot be mapped onto the parameters")
        self.import_state(state_dict["state"], self._positions(), state_dict)

    # -- the step --------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        # Scale (fp16) so small gradients stay representable in half precision.
        (loss * self.loss_scale if self.scaler is not None else loss).backward(*args, **kwargs)
        self._scaled_backward = True
        self._after_backward()

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward from an upstream gradient (pipeline stages): `grad` is already scaled by the
        last stage's loss scaling, so no scaling here."""
        torch.autograd.backward(tensor, grad)
        self._scaled_backward = True
        self._after_backward()

    def _after_backward(self) -> None:
        pass

    def _found_inf(self, grads) -> bool:
        """Overflow anywhere on any rank of the step: one all-reduce MAX over the world group, which
        also carries whether some rank made its gradients without the loss scale (`loss.backward()`
        instead of `booster.backward`), so every rank raises together."""
        flags = torch.zeros(2, device=self.mesh.device)
        for g, _ in grads:
            flags[0] += (~torch.isfinite(g)).any()
        flags[1] = float(bool(grads) and not self._scaled_backward)
        if dist.is_initialized():
            comm.all_reduce(flags, self.mesh.world_group, op=dist.ReduceOp.MAX)
        if flags[1] > 0:
            self._release_grads()
            raise RuntimeError(
                "fp16: gradients reached optimizer.step() without the loss scale: call booster.backward(loss, "
                "optimizer) (or optimizer.backward(loss)) instead of loss.backward(), or the update is "
                f"{self.loss_scale:g}x too small. The gradients were dropped and the weights are unchanged")
        return bool(flags[0] > 0)

    def check_before_update(self, check: Callable[[], None]) -> None:
        """Run `check()` first in every `step()`, before anything changes. It must decide alike on every
        rank of the step (a verdict agreed over them: the boosted model's "no labelled token in the
        global batch"); when it raises, the gradients are dropped and the weights stay unchanged."""
        self._update_checks = (*self._update_checks, check)

    def average_at_step(self, reductions) -> None:
        """Average the gradients of each (params, group) pair over its group first in every `step()`:
        weights that nothing reduces during backward (expert-parallel experts beside torch DDP, which
        averages the dense weights over dp). Every rank of a group holds gradients for the same
        parameters (expert parallelism gives unrouted experts zero gradients)."""
        self._step_reductions = tuple((list(params), group) for params, group in reductions)

    def step(self, closure=None):
        if closure is not None:
            raise ValueError("closures are not supported by the mixed-precision/ZeRO optimizer")
        for check in self._update_checks:
            try:
                check()
            except Exception:
                self._release_grads()
                self._drop_requests()
                raise
        for params, group in self._step_reductions:
            comm.all_reduce_grads(params, group, average=True)
        grads = self._master_grads()
        if self.scaler is not None and self._found_inf(grads):
            # Every rank saw the same verdict: skip together, keep weights bitwise unchanged.
            self._grad_norm, self._norm_untracked = None, False
            self._release_grads()
            self._drop_requests()
            self.scaler.update(found_inf=True)     # raises after too many skips at the minimum scale
            if self.verbose and (not dist.is_initialized() or dist.get_rank() == 0):
                logger.info("fp16 overflow (inf/nan gradients): step skipped, loss scale now %g", self.loss_scale)
            return None
        inv_scale = 1.0 / self.loss_scale
        # The norm costs a pass over every gradient and a world all-reduce: only clipping and
        # track_grad_norm pay for it (the same decision on every rank: both are per-optimizer settings).
        # clip_grad_by_norm's request (step_requests.py) replaces the config's max_norm for this step.
        max_norm, norm_type = self._take_norm_request()
        self._grad_norm, self._norm_untracked = None, not (max_norm > 0 or self.track_grad_norm)
        if not self._norm_untracked:
            norm = global_grad_norm([g for g, counted in grads if counted], self.mesh.world_group, norm_type,
                                    self.mesh.device)
            self._grad_norm = norm * inv_scale
        self._unscale_and_clip(grads, inv_scale * (1.0 if self._norm_untracked
                                                   else clip_coefficient(self._grad_norm, max_norm)))
        self._apply_value_request()          # clip_grad_by_value's: element-wise, on the masters' final grads
        self.optim.step()
        self._write_back()
        if self.scaler is not None:
            self.scaler.update(found_inf=False)
        self._clear_master_grads()
        self._scaled_backward = False
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._release_grads()

    def get_loss_scale(self) -> float:
        return self.loss_scale

    @contextlib.contextmanager
    def no_sync(self):
        """Inside the block backward does not reduce gradients over dp (they accumulate locally)."""
        previous, self._grad_sync = self._grad_sync, False
        try:
            yield
        finally:
            self._grad_sync = previous
