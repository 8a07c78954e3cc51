"""Tensor-parallel MoE experts: transformers' packed expert tensors split inside every expert.

Owns: checking and sharding an experts module in transformers' packed layout (`gate_up_proj`
`[E, 2I, H]` and `down_proj` `[E, H, I]`, or transposed, `[E, H, 2I]` and `[E, I, H]`, as Llama-4
stores them: `is_transposed`), and the two collectives around its forward. Every rank keeps all E
experts, each cut on its intermediate dimension I: rank r holds rows r of both halves of `gate_up`
(`num_fused=2`; an interleaved [g0, u0, g1, u1, ...] layout is cut in contiguous pairs) and the
matching columns of `down`, so `act(gate) * up` and the down projection run on this rank's slice and
the experts' output is a partial sum. Megatron's f on the experts' floating inputs (the hidden states
and the routing weights, whose gradients are partial per rank) and g (one all-reduce) on its output
make it exact: the router stays replicated and gets its whole gradient on every rank. The HF forward
(eager or any `_experts_implementation`) runs unchanged on the local shapes. Must not route tokens or
know a model family; expert parallelism (experts split over ranks, `expert_parallel.py`) is not this
file, but which forward an experts module runs is decided here, once, for tp, ep and tp x ep
(`ExpertsForward`, kept by module in this file's registry): tp alone, the two collectives as hooks
around the HF forward; with ep, expert parallelism's dispatching forward, which runs them around the
local experts itself (every tp rank received the same rows).

Under sequence parallelism (Megatron's layout for tensor-parallel experts) each tp rank routes its own
chunk of the sequence, so the experts' inputs (hidden states, expert ids, routing weights) are
all-gathered over tp along the token dim before the experts run (the floating ones' gradients
reduce-scattered back), every rank's slice of I runs on every token with no f, and the partial output
is reduce-scattered onto this rank's tokens instead of all-reduced (its gradient all-gathered). Then the
gradients of the hidden states and of the routing weights leave each rank partial (its slice of I) and
the gather's reduce-scatter sums them, so the router, fed only this rank's tokens, gets each token's
whole gradient exactly once: its weight gradient is summed over tp by `sequence.py`, as a norm's.
"""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field, replace
from functools import partial
from weakref import WeakKeyDictionary

import torch
import torch.nn as nn

from meshboost.distributed import comm
from meshboost.distributed.param_info import register_grad_hook
from meshboost.shardformer.layers.linear import shard_parameter_, sum_grad_over_tp

UP_PARAMS = ("gate_up_proj", "up_proj")     # [gate; up] packed, or up alone (experts without a gate)


@dataclass(frozen=True)
class TensorParallelExperts:
    """How `shard_experts_` cut an experts module: its tp group, the down-projection bias whose repeated
    terms the output's correction takes off (None without biases), and whether the experts' tokens are
    sequence-parallel (each tp rank routed its own chunk: see the docstring)."""

    group: object
    bias_name: str | None
    seq_parallel: bool = False

    def copy_inputs(self, module, args, kwargs):
        """f on the floating inputs (and the expert-id check): `_copy_inputs`; under sequence
        parallelism only the check (the gathered inputs' gradients are summed by the gather)."""
        return _copy_inputs(self.group, module, args, kwargs, apply_f=not self.seq_parallel)

    def reduce_output(self, module, args, kwargs, output):
        """g on the output (with the bias correction): `_reduce_output`; under sequence parallelism
        the bias correction only, the partial sums left for `scatter_tokens`."""
        return _reduce_output(self.group, self.bias_name, module, args, kwargs, output, reduce=not self.seq_parallel)

    def gather_tokens(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Sequence parallelism: every tensor input all-gathered over tp along its token dim (0)."""
        return _gather_tokens(self.group, args, kwargs)

    def scatter_tokens(self, output):
        """Sequence parallelism: the partial output summed over tp, this rank's tokens kept."""
        return _map_output(output, lambda out: comm.reduce_scatter_to_seq(out, self.group, dim=0))


@dataclass(frozen=True)
class ExpertsForward:
    """The one record of how an experts module's forward runs: `tp` (its experts cut on I), `ep` (its
    experts dealt over ep ranks: `expert_parallel.ExpertParallelForward`, a floor above this file, so
    named by what it does: `ep.run(module, tp, args, kwargs)`), or both. `handles`: what
    `set_experts_forward` installed for it, removed when the layout grows."""

    tp: TensorParallelExperts | None = None
    ep: object | None = None
    handles: tuple = field(default=(), compare=False)


# The one owner of every experts module's forward: keyed weakly by module, so the record is typed, nothing
# is set on the module on the side (but the dispatching forward, below), and a dropped model is freed.
_EXPERTS: WeakKeyDictionary[nn.Module, ExpertsForward] = WeakKeyDictionary()


def experts_forward(module: nn.Module) -> ExpertsForward:
    """How `module`'s forward runs now (an empty record when meshboost has not split its experts)."""
    return _EXPERTS.get(module, ExpertsForward())


def set_experts_forward(module: nn.Module, **changes) -> ExpertsForward:
    """Decide `module`'s forward from its record with `changes` (tp=..., ep=...) and install it, in place
    of what this function installed before: with ep, the dispatching forward (it runs tp's collectives
    around the local experts itself); tp alone, f before and g after the HF forward as hooks (with
    sequence parallelism the token gather before, the reduce-scatter after). Returns the record."""
    record = replace(experts_forward(module), **changes)
    for handle in record.handles:
        handle.remove()
    if isinstance(module.__dict__.get("forward"), _DispatchingForward):
        del module.__dict__["forward"]
    handles: tuple = ()
    if record.ep is not None:
        # torch calls `module.forward`, and no hook can replace the computation a forward does: the
        # dispatch is set as the module's forward (as regional compile sets a block's), holding it weakly
        module.forward = _DispatchingForward(module, record)
    elif record.tp is not None:
        handles = (module.register_forward_pre_hook(partial(_tp_pre_hook, record.tp), with_kwargs=True),
                   module.register_forward_hook(partial(_tp_post_hook, record.tp), with_kwargs=True))
    record = replace(record, handles=handles)
    _EXPERTS[module] = record
    return record


class _DispatchingForward:
    """An experts module's forward under expert parallelism: its record's `ep.run`. A strong reference
    back to the module would make a cycle that keeps a dropped model alive until gc.collect()."""

    def __init__(self, module: nn.Module, record: ExpertsForward):
        self._module, self.record = weakref.ref(module), record

    def __call__(self, *args, **kwargs):
        return self.record.ep.run(self._module(), self.record.tp, args, kwargs)


def is_packed_experts(module: nn.Module) -> bool:
    """A module holding transformers' packed experts directly: 3-D `gate_up_proj` (or `up_proj`) and
    `down_proj` parameters."""
    up = _up_name(module)
    down = getattr(module, "down_proj", None)
    return up is not None and isinstance(down, nn.Parameter) and down.dim() == 3 and getattr(module, up).dim() == 3


def _up_name(module: nn.Module) -> str | None:
    names = [n for n in UP_PARAMS if isinstance(getattr(module, n, None), nn.Parameter)]
    return names[0] if len(names) == 1 else None


def expert_dims(module: nn.Module) -> tuple[int, int]:
    """(dim of the up projection that holds 2I (or I), dim of down_proj that holds I): [E, 2I, H] and
    [E, H, I], or transposed ([E, H, 2I] and [E, I, H], Llama-4's), as the module says
    (`is_transposed`) or, for a module that does not say, as the shapes say."""
    up, down = getattr(module, _up_name(module)), module.down_proj
    transposed = getattr(module, "is_transposed", None)
    if transposed is None:         # [gate; up] tells: its 2I sits where down_proj has I (an up alone cannot)
        transposed = _up_name(module) == "gate_up_proj" and up.shape[2] == 2 * down.shape[1]
    return (2, 1) if transposed else (1, 2)


def _fused(module: nn.Module, interleaved: bool) -> int:
    """Blocks along the up projection's I dim: 2 for [gate; up] halves, 1 for interleaved pairs
    [g0, u0, g1, u1, ...] (cut in contiguous pairs) or an up projection alone."""
    if _up_name(module) == "up_proj" or interleaved:
        return 1
    return 2 if getattr(module, "is_concatenated", True) else 1


def check_sequence_parallel(path: str, module: nn.Module) -> None:
    """Refuse (pure, before anything is modified) experts sequence parallelism cannot feed token by
    token: their forward must take (hidden_states [tokens, H], expert ids, routing weights), whose
    token dim the tp ranks' chunks are gathered along. One row block per expert (Llama-4's
    [E * tokens, H]) would be gathered expert-blocks out of order."""
    params = [p for p in inspect.signature(type(module).forward).parameters if p != "self"]
    if len(params) != 3:
        raise NotImplementedError(f"{path} ({type(module).__name__}.forward({', '.join(params)})): sequence "
                                  "parallelism gathers the experts' tokens over tp from (hidden_states, expert ids, "
                                  "routing weights), which these experts do not take; use "
                                  "enable_sequence_parallelism=False for this model")


def _biases(up_name: str | None) -> tuple[str, str]:
    """The bias names that go with the up projection `up_name` and with down_proj."""
    return (f"{up_name}_bias", "down_proj_bias")


def check_experts(path: str, module: nn.Module, tp_size: int, interleaved: bool = False) -> None:
    """Refuse (before anything is modified) an experts module this style cannot split exactly.
    interleaved: the up projection's gate and up rows alternate (GPT-OSS), which the module does not
    say itself; a policy that knows it uses the interleaved style."""
    params = dict(module.named_parameters(recurse=False))
    up_name = _up_name(module)
    up_bias, down_bias = _biases(up_name)
    extra = sorted(set(params) - {up_name, "down_proj", up_bias, down_bias})
    if up_name is None or "down_proj" not in params or extra or ((up_bias in params) != (down_bias in params)):
        raise ValueError(f"{path} ({type(module).__name__}): parameters {sorted(params)} are not the packed experts "
                         "meshboost splits (gate_up_proj or up_proj, and down_proj, both with or both without a "
                         "bias; no scales); use tp_size=1 for this model (data and pipeline parallelism need no plan)")
    up, down = params[up_name], params["down_proj"]
    if up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{path} ({type(module).__name__}): expected packed 3-D expert tensors, found {up_name} "
                         f"{tuple(up.shape)} and down_proj {tuple(down.shape)}; use tp_size=1")
    g, d = expert_dims(module)
    width = 2 if up_name == "gate_up_proj" and getattr(module, "has_gate", True) else 1
    if up.shape[0] != down.shape[0] or up.shape[g] != width * down.shape[d] or up.shape[3 - g] != down.shape[3 - d]:
        raise ValueError(f"{path}: {up_name} {tuple(up.shape)} and down_proj {tuple(down.shape)} do not form "
                         f"[E, {width}I, H] / [E, H, I] (or the transposed layout); meshboost cannot tell which "
                         "dimension is the experts' intermediate one: use tp_size=1")
    inter = down.shape[d]
    if inter % tp_size:
        raise ValueError(f"{path}: the experts' intermediate size {inter} is not divisible by tp_size={tp_size}; "
                         f"choose a tp_size that divides {inter}")
    if up_bias in params and (tuple(params[up_bias].shape) != (up.shape[0], up.shape[g])
                              or tuple(params[down_bias].shape) != (down.shape[0], down.shape[3 - d])):
        raise ValueError(f"{path}: biases {up_bias} {tuple(params[up_bias].shape)} and {down_bias} "
                         f"{tuple(params[down_bias].shape)} do not match the experts' [E, {width}I] and [E, H]; use "
                         "tp_size=1")


def expert_splits(module: nn.Module, interleaved: bool = False) -> dict[str, tuple[int, int]]:
    """{parameter name: (dim, fused blocks)} of what `shard_experts_` splits over tp: the up projection
    on its intermediate dim, down_proj on its own, the up bias with the up rows; the down bias (if
    any) stays whole, its gradient summed over tp. The planner (meshboost.plan) reads it."""
    g, d = expert_dims(module)
    up_name = _up_name(module)
    fused = _fused(module, interleaved)
    out = {up_name: (g, fused), "down_proj": (d, 1)}
    up_bias, down_bias = _biases(up_name)
    if isinstance(getattr(module, down_bias, None), nn.Parameter):
        out[up_bias] = (1, fused)
    return out


def shard_experts_(module: nn.Module, group, interleaved: bool = False, seq_parallel: bool = False) -> None:
    """Split every expert of `module` over `group` on its intermediate dimension, in place (the same
    parameter objects, each with its tensor-parallel record), and install f before and g after its
    forward (seq_parallel: the token gather before, the reduce-scatter after). With biases, the up
    projection's bias is split with its rows; the down projection's is whole on every rank, so the
    output's bias terms, added by each rank's partial sum, are taken back to one before the sum
    (`_reduce_output`) and its gradient is summed over tp."""
    g, d = expert_dims(module)
    up_name = _up_name(module)
    fused = _fused(module, interleaved)
    shard_parameter_(getattr(module, up_name), g, group, num_fused=fused)
    shard_parameter_(module.down_proj, d, group)
    up_bias, down_bias = _biases(up_name)
    has_bias = isinstance(getattr(module, down_bias, None), nn.Parameter)
    if has_bias:
        shard_parameter_(getattr(module, up_bias), 1, group, num_fused=fused)
        register_grad_hook(getattr(module, down_bias), partial(sum_grad_over_tp, group))
    set_experts_forward(module, tp=TensorParallelExperts(group, down_bias if has_bias else None, seq_parallel))


def _tp_pre_hook(tp: TensorParallelExperts, module, args, kwargs):
    if tp.seq_parallel:
        args, kwargs = tp.gather_tokens(args, kwargs)
    return tp.copy_inputs(module, args, kwargs)


def _tp_post_hook(tp: TensorParallelExperts, module, args, kwargs, output):
    output = tp.reduce_output(module, args, kwargs, output)
    return tp.scatter_tokens(output) if tp.seq_parallel else output


def _gather_tokens(group, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The experts' tensor inputs (hidden states [tokens, H], expert ids and routing weights [tokens, k])
    of every tp rank, concatenated along the token dim: ids plainly, the floating ones all-gathered
    forward and their (partial) gradients reduce-scattered backward. The ids are gathered first and
    checked by `_copy_inputs` after, so a bad id routed on one rank is refused on every rank."""
    def gather(t):
        if not torch.is_tensor(t) or t.dim() == 0:
            return t
        return comm.gather_from_seq(t, group, dim=0) if t.is_floating_point() else comm.all_gather(t, group, dim=0)
    return tuple(gather(a) for a in args), {k: gather(v) for k, v in kwargs.items()}


def _copy_inputs(group, module, args, kwargs, apply_f: bool = True):
    """f on the experts' floating inputs that carry gradient (hidden states, routing weights): identity
    forward, their gradients summed over tp backward (each rank's experts saw a slice of I). The expert
    ids are checked first: transformers' experts skip an id equal to their count without a word, which
    would train on a plausible, wrong loss. apply_f False: the check only."""
    for t in (*args, *kwargs.values()):
        if torch.is_tensor(t) and not t.is_floating_point() and t.dtype != torch.bool:
            check_expert_ids(t, module.down_proj.shape[0], type(module).__name__)
    if not apply_f:
        return args, kwargs

    def f(t):
        return comm.copy_to_tp(t, group) if torch.is_tensor(t) and t.is_floating_point() and t.requires_grad else t
    return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}


def check_expert_ids(ids: torch.Tensor, num_experts: int, what: str) -> None:
    """Raise when a routed expert id is outside [0, num_experts): on the CPU at once (every tp rank
    holds the same ids, so every rank raises before the layer's collective); on an accelerator as a
    device-side assertion, without a host sync."""
    if ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= num_experts)
    if ids.device.type == "cpu":
        if bool(bad.any()):
            raise ValueError(f"{what}: a token was routed to expert id {int(ids[bad][0])}, outside the "
                             f"{num_experts} experts [0, {num_experts}); the router (or a custom one) is wrong")
    else:
        torch._assert_async(~bad.any(), f"{what}: a token was routed to an expert id outside [0, {num_experts})")


def _map_output(output, fn):
    """`fn` on the experts' output tensor (itself, or the first item of a tuple)."""
    out = output if torch.is_tensor(output) else output[0] if isinstance(output, tuple) and output else None
    if not torch.is_tensor(out):
        raise TypeError(f"experts returned {type(output).__name__}; tensor-parallel experts expect a tensor (the "
                        "weighted expert output)")
    out = fn(out)
    return out if torch.is_tensor(output) else (out, *output[1:])


def _reduce_output(group, bias_name, module, args, kwargs, output, reduce: bool = True):
    """g on the experts' output: the partial sums over this rank's slice of I, all-reduced once. A
    down-projection bias was added by every rank's partial sum (weighted by each token's routing
    weights): (tp - 1) / tp of those terms come off before the sum, so it holds them once, and their
    gradient reaches the routing weights (through f, or the token gather's reduce-scatter: summed
    over tp) exactly once too. reduce False: the correction only (the caller sums)."""
    return _map_output(output, partial(_reduce_tensor, group, bias_name, module, args, kwargs, reduce))


def _reduce_tensor(group, bias_name, module, args, kwargs, reduce: bool, out: torch.Tensor) -> torch.Tensor:
    if bias_name is not None:
        tensors = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t)]
        ids = next(t for t in tensors if not t.is_floating_point() and t.dtype != torch.bool)
        weights = next(t for t in tensors if t.is_floating_point() and t.shape == ids.shape)
        size = torch.distributed.get_world_size(group)
        terms = (weights.unsqueeze(-1) * getattr(module, bias_name)[ids]).sum(dim=-2)
        out = out - terms.to(out.dtype) * ((size - 1) / size)
    return comm.reduce_from_tp(out, group) if reduce else out
