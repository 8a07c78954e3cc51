"""The one optimizer-state format: per parameter, full and unpadded tensors.

Owns: what an entry is, how one is built from a rank's local state (tp shards gathered by the
parameter's record) and cut back into a rank's local layout, and the checks a loaded entry must
pass. Every optimizer wrapper exports and imports through these (`OptimizerWrapper.export_state`,
`import_state`, `state_dict`), and the checkpoint files hold the same entries, so there is one
format. Must not know where masters live (the wrappers do) nor how files look (checkpoint/).

An entry, for one parameter of full shape S:
    {"per_element": {state key: full tensor of shape S},     # Adam's exp_avg, exp_avg_sq
     "scalar":      {state key: value},                      # Adam's step (stored per parameter)
     "master":      full fp32 tensor of shape S}             # only where masters are kept apart
Next to the entries ("meta"): "param_groups" (hyperparameters, params listed by key) and, with a
loss scaler, "loss_scaler" (its state_dict).
"""

from __future__ import annotations

import torch

from meshboost.distributed.param_info import full_on_cpu, full_shape, gather_tensor, get_tp_info, shard_from

FORMAT = "meshboost-optimizer-v1"


def is_per_element(value, like: torch.Tensor) -> bool:
    """A state value laid out like the parameter (a moment), as opposed to a scalar (a step)."""
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == like.shape


def cpu_copy(value):
    return value.detach().to("cpu", copy=True) if torch.is_tensor(value) else value


def build_entry(param: torch.Tensor, state: dict, master: torch.Tensor | None, fresh: bool = False,
                live: bool = False) -> dict:
    """The entry of `param` from its state and master laid out like `param` on this rank (a
    collective over the tp group for a tp-sharded parameter). fresh: the tensors are temporaries
    (gathered for this call), handed on without another copy; otherwise live state is copied.
    live: the full tensors stay where they are, possibly the live state itself (read them before the
    next step, never write them): an asynchronous checkpoint save copies them into its host buffers."""
    info = get_tp_info(param)
    full = (lambda v: gather_tensor(v.detach(), info)) if live else (lambda v: full_on_cpu(v, info, fresh))
    entry = {"per_element": {k: full(v) for k, v in sorted(state.items()) if is_per_element(v, param)},
             "scalar": {k: cpu_copy(v) for k, v in state.items() if not is_per_element(v, param)}}
    if master is not None:
        entry["master"] = full(master)
    return entry


def local_part(full: torch.Tensor, param: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's part (tp shard, zero-padded like the parameter) of a full saved tensor, as a
    tensor of its own (never a view into a memory-mapped checkpoint file)."""
    info = get_tp_info(param)
    part = full if info is None else shard_from(full.__getitem__, tuple(full.shape), info, what)
    return part.clone(memory_format=torch.contiguous_format)


def check_entry(key, entry, param: torch.Tensor) -> None:
    """Raise naming `key` when `entry` is not an entry for a parameter shaped like `param`."""
    if not isinstance(entry, dict) or not {"per_element", "scalar"} <= set(entry):
        raise ValueError(f"optimizer state {key!r} is not a meshboost optimizer-state entry (per_element, scalar, "
                         "master); was it saved by save_optimizer / state_dict of a meshboost optimizer?")
    want = full_shape(param)
    tensors = [(f"state {k!r}", v) for k, v in entry["per_element"].items()]
    if "master" in entry:
        tensors.append(("master weight", entry["master"]))
    for what, tensor in tensors:
        if tuple(tensor.shape) != want:
            raise ValueError(f"optimizer {what} of {key!r} has shape {tuple(tensor.shape)}, the parameter is "
                             f"{want}; the checkpoint belongs to another model or configuration")


def nbytes(entry: dict) -> int:
    """Bytes of the tensors an entry holds (what it costs in a checkpoint file)."""
    tensors = list(entry["per_element"].values()) + ([entry["master"]] if "master" in entry else [])
    return sum(t.numel() * t.element_size() for t in tensors)


def to_device(value, device):
    """Per-element state goes to the parameter's device; scalars stay where they were saved (Adam
    keeps `step` on the CPU unless capturable/fused)."""
    return value.to(device) if torch.is_tensor(value) and value.dim() > 0 else value
