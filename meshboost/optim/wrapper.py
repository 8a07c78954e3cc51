"""OptimizerWrapper: the boosted optimizer's base, and its state keyed by parameter.

Owns: the torch.optim.Optimizer surface every boosted optimizer keeps (param_groups, step,
zero_grad, ...), the backward hooks plugins call, and the export/import of optimizer state in the
one format of `state.py`, keyed by whatever the caller names parameters with (HF names for
checkpoints, positions for `state_dict`). Subclasses only say where a parameter's state and master
live (`_local_state`, `_import_param`). A plain wrapper holds the user's unchanged torch optimizer
(TorchDDPPlugin, no plugin), so its `state_dict` is torch's own.
"""

from __future__ import annotations

from typing import Iterator, Mapping

import torch
from torch.optim import Optimizer

from meshboost.distributed.ownership import WeakAttribute
from meshboost.optim import state as fmt


class OptimizerWrapper:
    """A boosted optimizer. Plain pass-through here; precision and ZeRO wrappers override
    `backward`, `step` and where state lives."""

    scaler = None           # a loss scaler with state_dict()/load_state_dict(), in wrappers that scale
    _gathers_state = False  # `_local_state` returns temporaries (ZeRO's gathered partitions), not live state
    boosted_model = WeakAttribute()    # the model `Booster.boost` paired with it (weakly): states are keyed by its names

    def __init__(self, optim: Optimizer):
        self.optim = optim

    # -- the torch.optim.Optimizer surface ------------------------------------------------------
    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def defaults(self):
        return self.optim.defaults

    @property
    def state(self):
        return self.optim.state

    def add_param_group(self, *args, **kwargs):
        return self.optim.add_param_group(*args, **kwargs)

    def step(self, *args, **kwargs):
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True):
        self.optim.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.optim.state_dict()

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict)

    # -- ColossalAI's OptimizerWrapper calls ----------------------------------------------------------
    # Here the gradients are final after backward (torch DDP reduced them, or one process): these act at
    # once. Wrappers whose gradients are final only inside step() take them as requests (step_requests.py).
    _clip_norm: float | None = None

    def parameters(self) -> list[torch.Tensor]:
        """Every parameter of every param group (the masters where a wrapper keeps them), ColossalAI's list."""
        return [p for group in self.param_groups for p in group["params"]]

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                          *args, **kwargs) -> torch.Tensor:
        """torch's `clip_grad_norm_` over `parameters()`; returns the norm before clipping (also `get_grad_norm`)."""
        norm = torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, error_if_nonfinite)
        self._clip_norm = float(norm)
        return norm

    def clip_grad_by_value(self, clip_value: float, *args, **kwargs) -> None:
        """torch's `clip_grad_value_` over `parameters()`."""
        torch.nn.utils.clip_grad_value_(self.parameters(), clip_value)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("scale_loss: this optimizer has no loss scale (fp16 mixed precision scales the "
                                  "loss); call booster.backward(loss, optimizer)")

    def unscale_grad(self) -> None:
        raise NotImplementedError("unscale_grad: this optimizer has no loss scale (fp16 mixed precision scales the "
                                  "loss); drop the call")

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs) -> float | None:
        """The norm the last `clip_grad_by_norm` measured (None without one)."""
        return self._clip_norm

    # -- booster hooks -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, *args, **kwargs):
        loss.backward(*args, **kwargs)

    def backward_by_grad(self, tensor: torch.Tensor, grad: torch.Tensor) -> None:
        """Backward from an upstream gradient (a pipeline stage's output)."""
        torch.autograd.backward(tensor, grad)

    def unwrap(self) -> Optimizer:
        return self.optim

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optim!r})"

    # -- where state lives (subclasses override) --------------------------------------------------
    @property
    def working_param_groups(self) -> list[list[torch.Tensor]]:
        """The model parameters each param group trains."""
        return [list(g["params"]) for g in self.optim.param_groups]

    @property
    def keeps_masters(self) -> bool:
        """True when fp32 master weights live apart from the (half-precision) model weights."""
        return False

    def master_weight(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s fp32 master laid out like `param` on this rank, or None where the weight is its
        own master. Under ZeRO a collective over dp whose result only dp rank 0 gets: every dp rank
        calls it for the same params."""
        return None

    def sync_masters_from_model(self) -> None:
        """Refresh separate fp32 masters from the model's weights after the model was loaded in
        place (nothing to do where the weights are the masters)."""

    def _local_state(self, param: torch.Tensor, replica0_only: bool = False) -> tuple[dict, torch.Tensor | None]:
        """(`param`'s optimizer state laid out like `param` on this rank, its separate master or None).
        replica0_only: only data-parallel replica 0 needs the result (a wrapper that partitions
        state over dp may then gather it to dp rank 0 only)."""
        return self.optim.state.get(param, {}), None

    def _clear_state(self) -> None:
        self.optim.state.clear()

    def _import_param(self, param: torch.Tensor, state: dict, master: torch.Tensor | None) -> None:
        """Install `state` (laid out like `param` on this rank) and `master` (None: keep the weight)."""
        self.optim.state[param] = {k: fmt.to_device(v, param.device) for k, v in state.items()}

    def _after_import(self) -> None:
        """Masters changed: bring the working weights in line (mixed precision, ZeRO)."""

    # -- state keyed by parameter (optim/state.py) ------------------------------------------------
    def export_state(self, key_of: Mapping[torch.Tensor, object], replica0_only: bool = False,
                     live: bool = False) -> Iterator[tuple]:
        """(key, entry) for every trained parameter, in the same order on every rank; every rank must
        iterate to the end (ZeRO gathers each parameter's partitions over dp as it goes, tp shards are
        gathered over tp). replica0_only: entries only on data-parallel replica 0 (what a checkpoint
        writes), None elsewhere, so the other replicas skip the tp gathers and ZeRO sends each
        partition to dp rank 0 instead of to everyone. live: tensors not copied to the CPU
        (`state.build_entry`)."""
        here = not replica0_only or self._dp_rank() == 0
        for params in self.working_param_groups:
            for p in params:
                state, master = self._local_state(p, replica0_only)
                yield key_of[p], (fmt.build_entry(p, state, master, self._gathers_state, live) if here else None)

    def _dp_rank(self) -> int:
        """This rank's data-parallel coordinate (a plain wrapper has no mesh: every rank is a replica 0)."""
        return 0

    def export_meta(self, key_of: Mapping[torch.Tensor, object]) -> dict:
        """The format, the param groups (hyperparameters; params by key) and the loss-scaler state."""
        groups = []
        for group, params in zip(self.optim.param_groups, self.working_param_groups):
            saved = {k: fmt.cpu_copy(v) for k, v in group.items() if k != "params"}
            saved["params"] = [key_of[p] for p in params]
            groups.append(saved)
        meta = {"format": fmt.FORMAT, "param_groups": groups}
        if self.scaler is not None:
            meta["loss_scaler"] = self.scaler.state_dict()
        return meta

    @torch.no_grad()
    def import_state(self, entries: Mapping, key_of: Mapping[torch.Tensor, object], meta: dict) -> None:
        """Load entries (full tensors, any layout) and meta into this optimizer, in place. Every
        name, group and shape is checked before anything changes. Call on every rank (ZeRO writes the
        loaded masters back into the weights over dp)."""
        if meta.get("format", fmt.FORMAT) != fmt.FORMAT:
            raise ValueError(f"optimizer state of format {meta.get('format')!r}; this meshboost reads {fmt.FORMAT!r}")
        groups = self.working_param_groups
        saved_groups = meta["param_groups"]
        if len(saved_groups) != len(groups):
            raise ValueError(f"optimizer checkpoint has {len(saved_groups)} param groups, this optimizer "
                             f"{len(groups)}; build the optimizer with the same groups")
        for i, (params, saved) in enumerate(zip(groups, saved_groups)):
            known = set(saved["params"])
            stray = [key_of[p] for p in params if key_of[p] not in known]
            if stray:
                raise ValueError(f"param group {i}: parameters {stray[:5]} are not in the saved group {i}")
        missing = [key_of[p] for params in groups for p in params if key_of[p] not in entries]
        if missing:
            raise KeyError(f"the optimizer state has no entry for parameters {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}; it belongs to another model")
        for params in groups:
            for p in params:
                fmt.check_entry(key_of[p], entries[key_of[p]], p)

        for group, saved in zip(self.optim.param_groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
        self._clear_state()
        for params in groups:
            for p in params:
                key = key_of[p]
                entry = entries[key]
                local = {k: fmt.local_part(v, p, f"optimizer state {k!r} of {key!r}")
                         for k, v in entry["per_element"].items()}
                local.update({k: fmt.cpu_copy(v) for k, v in entry["scalar"].items()})
                master = fmt.local_part(entry["master"], p, f"master of {key!r}") if "master" in entry else None
                self._import_param(p, local, master)
        self._after_import()
        if self.scaler is not None and meta.get("loss_scaler") is not None:
            self.scaler.load_state_dict(meta["loss_scaler"])

    def _positions(self) -> dict:
        return {p: i for i, p in enumerate(p for params in self.working_param_groups for p in params)}
