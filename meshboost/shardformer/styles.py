"""Sharding styles and attribute rules: open registries, so a new family adds data, never an `elif`.

Owns: the style names a policy's plan may use ("colwise", "rowwise", "block_input",
"colwise_fused(3)", ...) and, for each, `validate` (pure: it runs on every rank before any module
is touched, so every rank raises the same error) and `apply` (returns the module to put at the
matched path, or None to keep the module, e.g. after adding a hook); the attribute rules
("divide") that set per-rank values on modules. `register_style` / `register_attribute_rule` add
entries. Must not decide where a linear sits: a style asks `ctx.regions` (the sharder's
`RegionPlan`, regions.py) for its `LinearRole` and hands it to the layer, and the block_input style
installs the hooks of the `BlockRegion` the plan made for its block. Must not know any model
family: families are tables in `policies/`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.distributed.param_info import register_grad_hook
from meshboost.shardformer.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, is_conv1d
from meshboost.shardformer.layers.experts import check_experts, shard_experts_
from meshboost.shardformer.layers.linear import shard_parameter_, sum_grad_over_tp
from meshboost.shardformer.layers.vocab import embedding_extras
from meshboost.shardformer.regions import RegionPlan

BLOCK_INPUT = "block_input"     # a module whose input feeds only column-parallel linears: Megatron f once
MOE_EXPERTS = "moe_experts"     # a packed experts module: f on its inputs, g on its output (layers/experts.py)
EXPERT_STYLES = (MOE_EXPERTS, MOE_EXPERTS + "_interleaved")
SPLITTING_STYLES = ("colwise", "colwise_fused", "colwise_heads")   # outputs stay split: the block works on shards
DEFAULT_BLOCK_INPUT_KWARGS = ("hidden_states", "encoder_hidden_states")


@dataclass
class ShardContext:
    """What every style's `apply` may read: the tp group and the plan's block regions, which give
    each linear its role (`regions.column_role(path)`, `regions.row_role(path)`)."""

    group: object
    tp_size: int
    regions: RegionPlan = field(default_factory=RegionPlan)
    make_vocab_size_divisible_by: int = 64

    @property
    def tp_rank(self) -> int:
        return dist.get_rank(self.group)


@dataclass(frozen=True)
class ShardStyle:
    """validate(path, module, tp_size, *args) raises on a module the style cannot shard;
    apply(ctx, path, module, *args) returns the replacement (or None to keep `module`)."""

    name: str
    validate: Callable[..., None]
    apply: Callable[..., nn.Module | None]
    num_args: int = 0
    # a style for a parameter path (`layers.*.self_attn.sinks`): validate(path, param, tp_size, *args),
    # apply(ctx, path, param, *args) shards the parameter in place
    on_parameter: bool = False
    # a style for a whole block (an attention) that shards the linears inside it itself: they count as
    # covered by the plan, and under sequence parallelism the block gathers its input once, as a block
    # holding column-parallel linears does (its code may view projections by its input's length)
    block: bool = False


STYLES: dict[str, ShardStyle] = {}
_SPEC = re.compile(r"^([A-Za-z_]\w*)(?:\(([^)]*)\))?$")


def register_style(name: str, validate: Callable[..., None], apply: Callable[..., nn.Module | None],
                   num_args: int = 0, on_parameter: bool = False, block: bool = False) -> None:
    """Add a style; `num_args` integer arguments are written `name(a, b)` in a plan. on_parameter: the
    plan names a parameter (a module's own tensor, such as attention sinks), not a module. block: the
    style shards a whole block's linears itself (see `ShardStyle.block`)."""
    if name in STYLES:
        raise ValueError(f"sharding style {name!r} is already registered")
    STYLES[name] = ShardStyle(name, validate, apply, num_args, on_parameter, block)


def parse_style(spec: str) -> tuple[ShardStyle, tuple[int, ...]]:
    """The registered style and its integer arguments for a plan entry such as 'colwise_fused(3)'."""
    m = _SPEC.match(spec) if isinstance(spec, str) else None
    style = STYLES.get(m.group(1)) if m else None
    if style is None:
        raise ValueError(f"unknown sharding style {spec!r}; registered: {sorted(STYLES)} "
                         "(add one with meshboost.shardformer.styles.register_style)")
    raw = [a.strip() for a in m.group(2).split(",")] if m.group(2) else []
    if len(raw) != style.num_args or not all(a.isdigit() and int(a) > 0 for a in raw):
        raise ValueError(f"sharding style {spec!r}: {style.name} takes {style.num_args} positive integer "
                         f"argument(s), e.g. {style.name}({', '.join(['3'] * style.num_args)})"
                         if style.num_args else f"sharding style {spec!r}: {style.name} takes no arguments")
    return style, tuple(int(a) for a in raw)


# -- linear styles ------------------------------------------------------------------------------
PLAIN_LINEARS: set[type] = set()     # nn.Linear subclasses whose forward is exactly x W^T + b


def register_plain_linear(cls: type) -> None:
    """Declare that `cls` (an nn.Linear subclass with a forward of its own, such as Falcon's
    FalconLinear) computes exactly what nn.Linear computes, so the linear styles may replace it."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Linear)):
        raise TypeError(f"register_plain_linear needs an nn.Linear subclass, got {cls!r}")
    PLAIN_LINEARS.add(cls)


def _check_linear(path: str, module: nn.Module, tp_size: int, column: bool, fused: int = 1) -> None:
    kind = "colwise" if column else "rowwise"
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise TypeError(f"{path}: style {kind!r} needs nn.Linear or Conv1D, found {type(module).__name__}")
    if isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward \
            and type(module) not in PLAIN_LINEARS:
        raise TypeError(f"{path}: {type(module).__name__} subclasses nn.Linear with a forward of its own, which a "
                        f"parallel linear would drop; leave it out of the plan or register a style for it")
    out_dim = 1 if is_conv1d(module) else 0
    dim = out_dim if column else 1 - out_dim
    size = module.weight.shape[dim]
    if size % (tp_size * fused):
        raise ValueError(f"{path}: {'output' if column else 'input'} features {size} are not divisible by "
                         f"tp_size={tp_size}" + (f" x {fused} fused blocks" if fused > 1 else ""))


def _colwise(ctx: ShardContext, path: str, module: nn.Module, fused: int = 1) -> nn.Module:
    return ColumnParallelLinear.from_native(module, ctx.group, num_fused=fused, role=ctx.regions.column_role(path))


def _rowwise(ctx: ShardContext, path: str, module: nn.Module) -> nn.Module:
    return RowParallelLinear.from_native(module, ctx.group, role=ctx.regions.row_role(path))


# -- block inputs -------------------------------------------------------------------------------
def _block_input(ctx: ShardContext, path: str, module: nn.Module) -> None:
    """Megatron's f once at the block's input (under sequence parallelism, the sequence all-gather):
    the hooks of the `BlockRegion` the sharder's plan made for this block, which the linears inside
    already hold through their roles."""
    ctx.regions.at(path).install(module)
    return None


def head_replicas(heads: int, tp_size: int, what: str) -> int:
    """How many consecutive tp ranks hold each of `heads` heads: 1 when they split over tp, tp / heads
    when fewer (each held by the ranks whose query heads use it); a ValueError naming `what` when
    neither divides the other, since no rank would hold whole heads."""
    if isinstance(heads, int) and heads > 0 and heads % tp_size == 0:
        return 1
    if isinstance(heads, int) and heads > 0 and tp_size % heads == 0:
        return tp_size // heads
    raise ValueError(f"{what}={heads!r} key/value heads over tp_size={tp_size}: every rank must hold whole heads, so "
                     f"use a tp_size that divides {heads} or is a multiple of it")


def _check_heads(path: str, module: nn.Module, tp_size: int, heads: int) -> None:
    _check_linear(path, module, 1, column=True)
    out = module.weight.shape[1 if is_conv1d(module) else 0]
    if out % heads:
        raise ValueError(f"{path}: {out} output features are not {heads} whole heads")
    head_replicas(heads, tp_size, path)


def _colwise_heads(ctx: ShardContext, path: str, module: nn.Module, heads: int) -> nn.Module:
    """Key/value heads: split like colwise when they divide over tp; with fewer heads than ranks,
    each head is held by the tp / heads ranks whose query heads use it (grouped-query attention)."""
    replicas = head_replicas(heads, ctx.tp_size, path)
    return ColumnParallelLinear.from_native(module, ctx.group, replicas=replicas, role=ctx.regions.column_role(path))


def _colwise_gather(ctx: ShardContext, path: str, module: nn.Module) -> nn.Module:
    # Its own Megatron f: a gathered projection (an output projection too, in Qwen3.5's linear
    # attention) need not read the enclosing block's input. When it does read it (OLMo2's q/k/v in a
    # block under sequence parallelism), the block's collective already covers it: its role holds
    # the block's region, and the forward skips f for the tensors the region's hook produced.
    return ColumnParallelLinear.from_native(module, ctx.group, gather_output=True,
                                            role=ctx.regions.column_role(path, own_f=True))


def _rowwise_split(ctx: ShardContext, path: str, module: nn.Module) -> nn.Module:
    return RowParallelLinear.from_native(module, ctx.group, input_is_parallel=False, role=ctx.regions.row_role(path))


# -- replicated parameters whose gradient each rank only has part of ------------------------------
def _check_has_params(path: str, module: nn.Module, tp_size: int) -> None:
    if not any(True for _ in module.parameters(recurse=False)):
        raise TypeError(f"{path}: style 'replicated_grad_allreduce' needs a module with parameters of its own")


def _replicated_grad_allreduce(ctx: ShardContext, path: str, module: nn.Module) -> None:
    """The module stays whole on every rank, but reads only this rank's heads (a q/k norm over
    head_dim): its gradient is summed over tp as it is produced."""
    for p in module.parameters(recurse=False):
        register_grad_hook(p, partial(sum_grad_over_tp, ctx.group))
    return None


# -- a norm applied per head to q or k ([batch, seq, heads, head_dim]) ------------------------------
def _check_head_norm(path: str, module: nn.Module, tp_size: int, heads: int) -> None:
    for name, p in module.named_parameters(recurse=False):          # none (a plain RMS norm): nothing to do
        if p.dim() == 2 and p.shape[0] != heads:
            raise ValueError(f"{path}.{name} of shape {tuple(p.shape)} is not one row per each of {heads} heads")
        if p.dim() > 2:
            raise ValueError(f"{path}.{name} of shape {tuple(p.shape)}: a per-head norm weight is [head_dim] or "
                             "[heads, head_dim]")
    head_replicas(heads, tp_size, path)


def _head_norm(ctx: ShardContext, path: str, module: nn.Module, heads: int) -> None:
    """A q/k norm that sees only this rank's heads. A weight shared by all heads ([head_dim]: Qwen3,
    GLM-4-MoE) stays whole and its gradient is summed over tp; one row per head ([heads,
    head_dim]: Cohere's use_qk_norm) is split by heads like the projection feeding it (key/value
    heads fewer than tp: each row held by the ranks whose query heads use it)."""
    replicas = head_replicas(heads, ctx.tp_size, path)
    for p in module.parameters(recurse=False):
        if p.dim() == 2:
            shard_parameter_(p, 0, ctx.group, replicas=replicas)
        else:
            register_grad_hook(p, partial(sum_grad_over_tp, ctx.group))
    return None


# -- per-head biases an attention module receives (ALiBi) -------------------------------------------
HEAD_BIAS_KWARGS = ("alibi", "attention_mask")


def _local_heads(t: torch.Tensor, batch: int, tp_size: int, rank: int, what: str) -> torch.Tensor:
    """This rank's heads of a bias laid out [batch * heads, q, k] (3-D) or [batch, heads, q, k]
    (4-D; a head dim of 1 broadcasts and is kept)."""
    if t.dim() == 4:
        if t.shape[1] == 1:
            return t
        heads, view = t.shape[1], t
    elif t.dim() == 3 and t.shape[0] % batch == 0:
        heads = t.shape[0] // batch
        view = t.reshape(batch, heads, *t.shape[1:])
    else:
        raise ValueError(f"{what} of shape {tuple(t.shape)} is neither [batch*heads, q, k] nor [batch, heads, q, k] "
                         f"for batch {batch}")
    if heads % tp_size:
        raise ValueError(f"{what} has {heads} heads, not divisible by tp_size={tp_size}")
    local = view.narrow(1, rank * (heads // tp_size), heads // tp_size)
    return local if t.dim() == 4 else local.reshape(batch * (heads // tp_size), *t.shape[1:])


def _slice_head_biases(tp_size: int, rank: int, path: str, module, args, kwargs):
    hidden = args[0] if args else kwargs.get("hidden_states")
    for key in HEAD_BIAS_KWARGS:
        value = kwargs.get(key)
        if torch.is_tensor(value) and value.is_floating_point():
            kwargs[key] = _local_heads(value, hidden.shape[0], tp_size, rank, f"{path}: {key}")
    return args, kwargs


def _heads_bias(ctx: ShardContext, path: str, module: nn.Module) -> None:
    """An attention module whose `alibi` (and, when ALiBi is folded into it, 4-D float
    `attention_mask`) carries one bias per head of the whole model: it receives this rank's heads."""
    module.register_forward_pre_hook(partial(_slice_head_biases, ctx.tp_size, ctx.tp_rank, path), with_kwargs=True)
    return None


# -- an embedding whose outputs are per-head values (T5's relative position bias) --------------------
def _check_embedding_heads(path: str, module: nn.Module, tp_size: int) -> None:
    if type(module) is not nn.Embedding:
        raise TypeError(f"{path}: style 'embedding_heads' needs a plain nn.Embedding, found {type(module).__name__}")
    if module.embedding_dim % tp_size:
        raise ValueError(f"{path}: {module.embedding_dim} heads are not divisible by tp_size={tp_size}")


def _embedding_heads(ctx: ShardContext, path: str, module: nn.Module) -> None:
    """The embedding's output features are heads: each rank keeps its heads' columns; its output
    stays split like a column-parallel output (no collective: each head's bias is its own)."""
    shard_parameter_(module.weight, 1, ctx.group)
    module.embedding_dim = module.weight.shape[1]
    return None


# -- the input embedding, when a plan names it --------------------------------------------------------
def _check_embedding(path: str, module: nn.Module, tp_size: int) -> None:
    if not isinstance(module, nn.Embedding):
        raise TypeError(f"{path}: style 'vocab_embedding' needs nn.Embedding, found {type(module).__name__}")
    embedding_extras(module)                   # raises for a subclass whose behaviour would be lost


def _vocab_embedding(ctx: ShardContext, path: str, module: nn.Module) -> nn.Module:
    return VocabParallelEmbedding.from_native(module, ctx.group, ctx.make_vocab_size_divisible_by)


register_style("colwise", lambda path, module, tp: _check_linear(path, module, tp, column=True), _colwise)
register_style("colwise_fused", lambda path, module, tp, n: _check_linear(path, module, tp, column=True, fused=n),
               _colwise, num_args=1)      # GPT-2 c_attn [q | k | v]: colwise_fused(3)
register_style("colwise_heads", _check_heads, _colwise_heads, num_args=1)   # k/v projections: colwise_heads(kv)
register_style("colwise_gather", lambda path, module, tp: _check_linear(path, module, tp, column=True),
               _colwise_gather)           # full output on every rank (e.g. before a whole-hidden q/k norm)
register_style("rowwise", lambda path, module, tp: _check_linear(path, module, tp, column=False), _rowwise)
register_style("rowwise_split", lambda path, module, tp: _check_linear(path, module, tp, column=False),
               _rowwise_split)            # replicated input: each rank first takes its slice
register_style("replicated_grad_allreduce", _check_has_params, _replicated_grad_allreduce)
register_style("vocab_embedding", _check_embedding, _vocab_embedding)
register_style(BLOCK_INPUT, lambda path, module, tp: None, _block_input)
register_style("head_norm", _check_head_norm, _head_norm, num_args=1)   # Cohere's q/k norm: head_norm(heads)
register_style("heads_bias", lambda path, module, tp: None, _heads_bias)            # ALiBi: this rank's heads
register_style("embedding_heads", _check_embedding_heads, _embedding_heads)        # T5's relative position bias
# transformers' packed MoE experts, every expert split on its intermediate dim (layers/experts.py); the
# interleaved variant for experts whose gate and up rows alternate ([g0, u0, g1, u1, ...]: GPT-OSS)
# (under sequence parallelism, in the split stack, each rank's tokens gathered before them: seq_parallel)
register_style(MOE_EXPERTS, check_experts, lambda ctx, path, module: shard_experts_(
    module, ctx.group, seq_parallel=ctx.regions.in_stack(path)))
register_style(EXPERT_STYLES[1], partial(check_experts, interleaved=True), lambda ctx, path, module: shard_experts_(
    module, ctx.group, interleaved=True, seq_parallel=ctx.regions.in_stack(path)))


def _check_split_heads(path: str, param: torch.Tensor, tp_size: int) -> None:
    if param.dim() < 1 or param.shape[0] % tp_size:
        raise ValueError(f"{path}: {tuple(param.shape)} holds one entry per head along dim 0, not divisible by "
                         f"tp_size={tp_size}; choose a tp_size that divides {param.shape[0] if param.dim() else 0}")


# a per-head parameter of a module (GPT-OSS's attention sinks): this rank's heads' entries
register_style("split_heads", _check_split_heads, lambda ctx, path, param: shard_parameter_(param, 0, ctx.group),
               on_parameter=True)


# -- attribute rules: (path, attribute, value, tp_size) -> the per-rank value, or raise -----------
def _divide(path: str, attr: str, value, tp_size: int):
    if not isinstance(value, int) or value % tp_size:
        raise ValueError(f"{path}.{attr}={value!r} is not divisible by tp_size={tp_size}; choose a tp_size "
                         f"that divides it")
    return value // tp_size


def _kv_heads(path: str, attr: str, value, tp_size: int):
    """Key/value heads per rank: split when they divide over tp, one (replicated) head per rank when
    tp is a multiple of them."""
    return 1 if head_replicas(value, tp_size, f"{path}.{attr}") > 1 else value // tp_size


def kv_groups(kv_heads: int) -> Callable:
    """The rule for an attention module's `num_key_value_groups` (query heads per key/value head):
    unchanged when the kv heads split over tp, the local query heads when each rank holds one
    replicated kv head."""
    def rule(path: str, attr: str, value, tp_size: int):
        return value if kv_heads % tp_size == 0 else value * kv_heads // tp_size
    return rule


ATTRIBUTE_RULES: dict[str, Callable] = {"divide": _divide, "kv_heads": _kv_heads}


def register_attribute_rule(name: str, rule: Callable) -> None:
    """Add a named rule(path, attribute, value, tp_size) -> per-rank value. A policy may also give
    the callable itself instead of a name."""
    if name in ATTRIBUTE_RULES:
        raise ValueError(f"attribute rule {name!r} is already registered")
    ATTRIBUTE_RULES[name] = rule


def attribute_rule(rule: str | Callable) -> Callable:
    """The callable for a rule given by name or as a callable; raises on an unknown name."""
    if callable(rule):
        return rule
    if rule not in ATTRIBUTE_RULES:
        raise ValueError(f"unknown attribute rule {rule!r}; registered: {sorted(ATTRIBUTE_RULES)} (or pass a "
                         "callable(path, attribute, value, tp_size))")
    return ATTRIBUTE_RULES[rule]
