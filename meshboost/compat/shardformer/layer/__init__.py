"""ColossalAI's path `shardformer.layer`: `Linear1D_Col` and `Linear1D_Row`, the layers its users write custom
policies with (and its test model zoo imports), as thin classes over meshboost's `ColumnParallelLinear` /
`RowParallelLinear`.

`Linear1D_Col.from_native_module(module, process_group, **kwargs)` shards an `nn.Linear` (or GPT-2's
`Conv1D`) in place by output features, `Linear1D_Row` by input features: the same parameters now hold this
rank's shard with meshboost's record on them, so the grad norm, ZeRO and checkpoints read them as any
sharded weight. Used alone (a model sharded by hand) a column applies Megatron's f itself and a row sums
its partial products with one all-reduce. In a meshboost `Policy` the styles "Linear1D_Col" and
"Linear1D_Row" (registered here, on import) build them with the role the sharder's plan gives the path,
so a custom policy written with ColossalAI's names shards exactly as "colwise" / "rowwise" do (with
sequence parallelism write "colwise" / "rowwise": the sharder gathers blocks by those names).

Their `state_dict()` holds whole tensors, as ColossalAI's layers' do (each sharded parameter gathered over the
group: a collective, call it on every rank), and `load_state_dict` takes whole tensors (each rank keeps its
slice, by the parameter's record) as well as this rank's shards. `state_dict(keep_vars=True)` gives the
parameters themselves, as torch's does: meshboost's own checkpoint code reads their records from it and gathers
itself, so `booster.save_model` / `load_model` see what they see for any sharded linear. A module built under
`LazyInitContext` is materialised once sharded (this rank's shard of the module's own init), as ColossalAI's
`from_native_module` does.

Refused, naming what to use: ColossalAI's keywords that change the numbers or the kernels and have no
meshboost equivalent (skip_bias_add, fp8_communication, split_sizes, use_zbv, seq_parallel_dim other than
1). Keywords about building fresh weights (initializers, dtype, device) do not apply: the module's own
weights are sharded. Owns nothing else.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.distributed.launch import get_current_device
from meshboost.distributed.param_info import full_shape, gather_tensor, get_tp_info, shard_tensor
from meshboost.lazy import lazy_seed, materialize
from meshboost.shardformer import register_style
from meshboost.shardformer.layers import ColumnParallelLinear, RowParallelLinear, is_conv1d

__all__ = ["Linear1D_Col", "Linear1D_Row"]

SEQUENCE_MODES = (None, "split_gather", "ring")       # "ring" is split_gather's layout (the same numbers)
_IGNORED = ("weight_initializer", "bias_initializer", "dtype", "device", "overlap", "stream_chunk_num")


def _group(process_group):
    """ColossalAI passes a group or a one-element list of groups."""
    if isinstance(process_group, (list, tuple)):
        if len(process_group) != 1:
            raise ValueError(f"from_native_module: {len(process_group)} process groups given; a 1D layer takes one")
        process_group = process_group[0]
    return process_group if process_group is not None else dist.group.WORLD


def _sequence_parallel(kwargs: dict, cls: str) -> bool:
    """ColossalAI's sequence-parallel keywords as meshboost's flag; refuses what has no equivalent."""
    refused = {k: kwargs[k] for k in ("skip_bias_add", "fp8_communication", "use_zbv") if kwargs.get(k)}
    if kwargs.get("split_sizes") is not None:
        refused["split_sizes"] = kwargs["split_sizes"]
    if refused:
        raise NotImplementedError(f"{cls}.from_native_module({', '.join(f'{k}={v!r}' for k, v in refused.items())}): "
                                  "not in meshboost's parallel linears; drop the argument (fused projections: "
                                  "the policy style 'colwise_fused(n)')")
    mode = kwargs.get("seq_parallel_mode")
    if mode not in SEQUENCE_MODES:
        raise ValueError(f"{cls}: seq_parallel_mode={mode!r}; over the tensor-parallel group use one of "
                         f"{SEQUENCE_MODES} (a sequence axis of its own is the plugin's sp_size)")
    if mode is not None and kwargs.get("seq_parallel_dim", 1) != 1:
        raise NotImplementedError(f"{cls}: seq_parallel_dim={kwargs['seq_parallel_dim']!r}; meshboost splits the "
                                  "sequence along dim 1 of [batch, seq, hidden]")
    unknown = set(kwargs) - {"skip_bias_add", "fp8_communication", "use_zbv", "split_sizes", "seq_parallel_mode",
                             "seq_parallel_dim", "gather_output", "parallel_input", "role", *_IGNORED}
    if unknown:
        raise TypeError(f"{cls}.from_native_module: unknown keyword(s) {sorted(unknown)}")
    return mode is not None


def _check(module: nn.Module, group, column: bool, cls: str) -> None:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise TypeError(f"{cls}.from_native_module needs an nn.Linear (or GPT-2's Conv1D), got {type(module).__name__}")
    dim = (1 if is_conv1d(module) else 0) if column else (0 if is_conv1d(module) else 1)
    size, tp = module.weight.shape[dim], dist.get_world_size(group)
    if size % tp:
        raise ValueError(f"{cls}: {'output' if column else 'input'} features {size} are not divisible by the "
                         f"group's {tp} ranks")


class _WholeStateDict:
    """ColossalAI's state dict of a parallel layer: whole tensors out, whole (or shard) tensors in."""

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:                         # the parameters themselves (their records): meshboost's checkpoints
            return
        for name, param in self._parameters.items():
            info = get_tp_info(param) if param is not None else None
            if info is not None:
                destination[prefix + name] = gather_tensor(param.detach(), info)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # `state_dict` is load_state_dict's own copy: a whole tensor is replaced there by this rank's slice
        for name, param in self._parameters.items():
            info = get_tp_info(param) if param is not None else None
            value = state_dict.get(prefix + name)
            if info is not None and torch.is_tensor(value) and tuple(value.shape) == full_shape(param) \
                    and value.shape != param.shape:
                state_dict[prefix + name] = shard_tensor(value, info)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


def _built(module: nn.Module, build):
    """`build()` (the sharded layer), materialised when `module` alone was built under LazyInitContext (a
    whole lazy model sharded by a policy is materialised by its sharder, with the model's own init)."""
    seed = lazy_seed(module)
    original = copy.deepcopy(module) if seed is not None else None      # on meta: no memory
    layer = build()
    if seed is not None:
        materialize(layer, original, get_current_device(), seed)
    return layer


class Linear1D_Col(_WholeStateDict, ColumnParallelLinear):
    """ColossalAI's column-parallel linear: output features split over the group (see the module docstring).
    gather_output: every rank gets the whole output (all-gathered)."""

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, *args, **kwargs) -> "Linear1D_Col":
        return _built(module, lambda: cls._shard(module, process_group, kwargs))

    @classmethod
    def _shard(cls, module: nn.Module, process_group, kwargs: dict) -> "Linear1D_Col":
        group = _group(process_group)
        seq_parallel = _sequence_parallel(kwargs, cls.__name__)
        _check(module, group, True, cls.__name__)
        return cls.from_native(module, group, gather_output=bool(kwargs.get("gather_output", False)),
                               seq_parallel=seq_parallel, role=kwargs.get("role"))


class Linear1D_Row(_WholeStateDict, RowParallelLinear):
    """ColossalAI's row-parallel linear: input features split over the group, partial products summed.
    parallel_input (ColossalAI's name; default True): the input already holds this rank's features (a
    column's output); False takes this rank's slice of a whole input first."""

    @classmethod
    def from_native_module(cls, module: nn.Module, process_group=None, *args, **kwargs) -> "Linear1D_Row":
        return _built(module, lambda: cls._shard(module, process_group, kwargs))

    @classmethod
    def _shard(cls, module: nn.Module, process_group, kwargs: dict) -> "Linear1D_Row":
        group = _group(process_group)
        seq_parallel = _sequence_parallel(kwargs, cls.__name__)
        _check(module, group, False, cls.__name__)
        return cls.from_native(module, group, input_is_parallel=bool(kwargs.get("parallel_input", True)),
                               seq_parallel=seq_parallel, role=kwargs.get("role"))


def _validate(column: bool):
    def validate(path: str, module: nn.Module, tp_size: int) -> None:
        name = "Linear1D_Col" if column else "Linear1D_Row"
        if not (isinstance(module, nn.Linear) or is_conv1d(module)):
            raise TypeError(f"{path}: style {name!r} needs nn.Linear or Conv1D, found {type(module).__name__}")
        dim = (1 if is_conv1d(module) else 0) if column else (0 if is_conv1d(module) else 1)
        if module.weight.shape[dim] % tp_size:
            raise ValueError(f"{path}: {'output' if column else 'input'} features {module.weight.shape[dim]} are "
                             f"not divisible by tp_size={tp_size}")
    return validate


# in a policy: a lazy model stays on meta here (its sharder materialises it whole, with the model's own init)
def _apply_col(ctx, path: str, module: nn.Module) -> nn.Module:
    return Linear1D_Col._shard(module, ctx.group, {"role": ctx.regions.column_role(path)})


def _apply_row(ctx, path: str, module: nn.Module) -> nn.Module:
    return Linear1D_Row._shard(module, ctx.group, {"role": ctx.regions.row_role(path)})


register_style("Linear1D_Col", _validate(True), _apply_col)
register_style("Linear1D_Row", _validate(False), _apply_row)
