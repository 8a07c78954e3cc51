"""Recurrent mixers split by heads over tp (Megatron's and torchtitan's layout), through transformers' own
forward: Gated DeltaNet with fused `in_proj_qkvz` / `in_proj_ba` (Qwen3-Next) and the Mamba2 mixer (Bamba,
Nemotron-H, GraniteMoeHybrid, ...).

Owns: recognising these two mixer shapes structurally (the parameters a module holds and the attributes its
forward reads; a mixer with anything more, such as Falcon-H1's muP multipliers, is left whole: the sweep says
"replicated"), the two block styles that shard one (`gated_deltanet`, `mamba2_mixer`); `policies.split_mixers`
puts them in a policy's plan in place of transformers' `colwise_gather_output` entries (weights split, outputs
gathered back, so the recurrence ran whole on every rank).

Each rank keeps whole head groups: the input projections are column-parallel (each of their segments split on
its own: `[z | x | B | C | dt]` in Mamba2; Qwen3-Next's qkvz/ba are grouped per key head, so a contiguous split
gives whole groups), the depthwise short convolution keeps its channels of each segment, `A_log`, `dt_bias`, `D`
their heads, the gated norm its groups (Qwen3-Next's [head_dim] weight is shared by every head: whole, its
gradient summed over tp), `out_proj` is row-parallel (one all-reduce). The per-rank geometry goes on the module
(`num_heads`, `n_groups`, `key_dim`, ...), never on the shared config. Must not fork a forward: the unmodified
torch fallback runs on the local heads. A fused kernel that consumes `out_proj`'s weight itself (transformers'
`mamba2_split_conv1d_scan_combined` once kernelized) would skip the all-reduce: `_require_out_proj` refuses it
at the first call. Checks are pure and raise on every rank before anything is modified.
"""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from meshboost.distributed.param_info import register_grad_hook
from meshboost.shardformer.layers import ColumnParallelLinear, RowParallelLinear
from meshboost.shardformer.layers.linear import shard_parameter_, sum_grad_over_tp
from meshboost.shardformer.styles import ShardContext, register_style

GATED_DELTANET, MAMBA2 = "gated_deltanet", "mamba2_mixer"
# what each forward reads, beside its parameters: (parameters, attributes)
_SHAPES = {
    GATED_DELTANET: ({"in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias",
                      "norm.weight", "out_proj.weight"},
                     ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "key_dim", "value_dim", "conv_dim")),
    MAMBA2: ({"in_proj.weight", "conv1d.weight", "A_log", "dt_bias", "D", "norm.weight", "out_proj.weight"},
             ("num_heads", "n_groups", "head_dim", "ssm_state_size", "intermediate_size", "conv_dim")),
}
_OPTIONAL = {"in_proj.bias", "conv1d.bias", "out_proj.bias"}       # Mamba2's mamba_proj_bias / conv_bias


def mixer_kind(module: nn.Module) -> str | None:
    """GATED_DELTANET, MAMBA2, or None for a module this file cannot split (it then stays whole). Pure."""
    params = {n for n, _ in module.named_parameters()}
    for kind, (needed, attributes) in _SHAPES.items():
        if needed <= params <= needed | _OPTIONAL and all(isinstance(getattr(module, a, None), int)
                                                          for a in attributes) \
                and not any(True for _ in module.buffers()) and isinstance(getattr(module, "conv1d"), nn.Conv1d):
            return kind
    return None


def _plain_linear(path: str, module: nn.Module) -> None:
    if type(module) is not nn.Linear:
        raise TypeError(f"{path}: a {type(module).__name__}, not a plain nn.Linear (a peft adapter on a recurrent "
                        "mixer's projections is not split by meshboost); leave the mixer's projections out of "
                        "target_modules, or use tp_size=1")


def _divides(path: str, what: str, value: int, tp_size: int, fix: str) -> None:
    if value % tp_size:
        raise ValueError(f"{path}: {what}={value} is not divisible by tp_size={tp_size}; each tp rank runs whole "
                         f"{fix} of this recurrent mixer, so choose a tp_size that divides {value} (or tp_size=1)")


def _validate(kind: str, path: str, module: nn.Module, tp_size: int) -> None:
    if mixer_kind(module) != kind:
        raise TypeError(f"{path}: style {kind!r} does not fit {type(module).__name__}")
    for name in ("in_proj_qkvz", "in_proj_ba", "out_proj") if kind == GATED_DELTANET else ("in_proj", "out_proj"):
        _plain_linear(f"{path}.{name}", getattr(module, name))
    if kind == GATED_DELTANET:
        _divides(path, "linear_num_key_heads", module.num_k_heads, tp_size, "key-head groups")
    else:
        _divides(path, "mamba_n_groups", module.n_groups, tp_size, "groups (with their B and C)")
        _divides(path, "mamba_n_heads", module.num_heads, tp_size, "heads")


def _split_conv(ctx: ShardContext, conv: nn.Conv1d, blocks: tuple[int, ...]) -> None:
    """A depthwise convolution over the channels [segment | segment | ...]: this rank's channels of each."""
    shard_parameter_(conv.weight, 0, ctx.group, blocks=blocks)
    if conv.bias is not None:
        shard_parameter_(conv.bias, 0, ctx.group, blocks=blocks)
    conv.in_channels = conv.out_channels = conv.groups = conv.weight.shape[0]


def _require_out_proj(path: str, mixer: nn.Module) -> None:
    """Raise when the mixer returns without having called its (row-parallel) out_proj: a fused kernel then
    multiplied by the weight shard itself and skipped the all-reduce."""
    calls = []
    mixer.register_forward_pre_hook(lambda module, args: calls.clear())
    mixer.out_proj.register_forward_hook(lambda module, args, out: calls.append(True))

    def check(module, args, out):
        if not calls:
            raise RuntimeError(f"{path}: {type(module).__name__} returned without calling out_proj (a fused kernel "
                               "read its weight directly), which skips tensor parallelism's all-reduce; run "
                               "transformers' torch path (do not kernelize the model) or use tp_size=1")
    mixer.register_forward_hook(check)


def _apply(kind: str, ctx: ShardContext, path: str, m: nn.Module) -> None:
    tp = ctx.tp_size
    role = partial(ctx.regions.column_role, own_f=True)      # each projection sums its own input gradient
    if kind == GATED_DELTANET:
        m.in_proj_qkvz = ColumnParallelLinear.from_native(m.in_proj_qkvz, ctx.group, role=role(f"{path}.in_proj_qkvz"))
        m.in_proj_ba = ColumnParallelLinear.from_native(m.in_proj_ba, ctx.group, role=role(f"{path}.in_proj_ba"))
        _split_conv(ctx, m.conv1d, (m.key_dim, m.key_dim, m.value_dim))          # [q | k | v]
        for p in (m.A_log, m.dt_bias):
            shard_parameter_(p, 0, ctx.group)
        register_grad_hook(m.norm.weight, partial(sum_grad_over_tp, ctx.group))  # one weight, every head
        for attr in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "conv_dim"):
            setattr(m, attr, getattr(m, attr) // tp)
    else:
        groups = m.n_groups * m.ssm_state_size
        blocks = (m.intermediate_size, m.intermediate_size, groups, groups, m.num_heads)     # [z | x | B | C | dt]
        m.in_proj = ColumnParallelLinear.from_native(m.in_proj, ctx.group, role=role(f"{path}.in_proj"), blocks=blocks)
        _split_conv(ctx, m.conv1d, (m.intermediate_size, groups, groups))        # [x | B | C]
        for p in (m.A_log, m.dt_bias, m.D, m.norm.weight):      # the norm's groups are whole on each rank
            shard_parameter_(p, 0, ctx.group)
        for attr in ("num_heads", "n_groups", "intermediate_size", "conv_dim"):
            setattr(m, attr, getattr(m, attr) // tp)
    m.out_proj = RowParallelLinear.from_native(m.out_proj, ctx.group, role=ctx.regions.row_role(f"{path}.out_proj"))
    _require_out_proj(path, m)
    return None


for _kind in (GATED_DELTANET, MAMBA2):
    register_style(_kind, partial(_validate, _kind), partial(_apply, _kind), block=True)
