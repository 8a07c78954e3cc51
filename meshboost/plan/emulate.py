"""Shape-only stand-ins for meshboost's sequence splits, so that the planner's fake-tensor forward
(activations.py) computes what one rank computes under them.

Owns:
- `SequenceRoles`: under Megatron sequence parallelism (split_gather), where the sharder's own plan
  (`ShardFormer.validate` with `enable_sequence_parallelism=True`: its refusals are the plugin's) cuts
  and restores the sequence: the layer stack, the blocks that gather their input once, the
  column-parallel linears that gather it themselves, the row-parallel linears whose output is
  reduce-scattered. `install_sequence_split` applies them to a model by hooks that slice or repeat
  the sequence dim instead of communicating, and counts the replicated parameters fed this rank's
  chunk (their gradients are summed over tp each backward, `sequence.install`'s rule);
- `install_context`: meshboost's own context-parallel attention (`shardformer/context.py`:
  `UlyssesAttention`, `GatheredKeysAttention`, with `ContextInputs.shard` cutting the inputs), its own
  exchange code running with shape-only collectives that allocate what the real ones allocate;
- `install_vocab_parallel_loss` and `install_chunked_loss`: the sharder's losses on the fake model (the
  chunked one by the runtime's own `install_chunked_loss`), their value checks and exchanges swapped out.
The real collectives' autograd functions save nothing for backward, and neither do these: what the
model saves is what the real layout saves. Must not communicate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn

SEQ_DIM = 1
COLUMN_STYLES = ("colwise", "colwise_fused", "colwise_heads", "colwise_gather")
ROW_STYLES = ("rowwise", "rowwise_split")


@dataclass(frozen=True)
class SequenceRoles:
    """Where split_gather cuts and restores the sequence, as paths relative to one layer of the stack
    (`stack`, from the model's root): blocks gathering their input (with the keyword names that may
    carry it), column-parallel linears gathering their own, row-parallel outputs reduce-scattered."""

    tp: int
    stack: str
    gather_blocks: tuple[tuple[str, tuple[str, ...]], ...]
    gather_columns: tuple[str, ...]
    split_rows: tuple[str, ...]


def sequence_roles(model: nn.Module, tp_size: int, make_vocab_size_divisible_by: int = 64) -> SequenceRoles:
    """The sharder's sequence-parallel plan of `model` (meta) at `tp_size`; raises what the plugin raises."""
    from meshboost.shardformer import ShardConfig, ShardFormer
    from meshboost.shardformer.policies import get_policy

    plan = ShardFormer(ShardConfig(make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                                   enable_sequence_parallelism=True)).validate(model, get_policy(model), tp_size)
    stack = plan.seq_stack_full
    pattern = re.compile(rf"^{re.escape(stack)}\.\d+\.(.+)$")

    def relative(paths) -> set[str]:
        # a peft LoRA layer's base (`X.base_layer`): the layer X itself, whose adapter's product joins the
        # base's inside meshboost's parallel linear (shardformer/lora.py), so it is gathered and split with it
        return {m.group(1).removesuffix(".base_layer") for p in paths if (m := pattern.match(p))}

    regions = plan.regions
    blocks = {}
    for path, region in regions.regions.items():
        if region.gathers:
            for rel in relative([path]):
                blocks[rel] = region.kwarg_names
    columns = relative(p for m in plan.matches if m.style.name in COLUMN_STYLES for p in m.paths
                       if regions.enclosing(p) is None)
    rows = relative(p for m in plan.matches if m.style.name in ROW_STYLES for p in m.paths)
    return SequenceRoles(tp_size, stack, tuple(sorted(blocks.items())), tuple(sorted(columns)), tuple(sorted(rows)))


class _Resize(torch.autograd.Function):
    """A collective's shape change without its data: forward a tensor of `shape`, backward one of the
    input's; saves nothing (as `comm`'s autograd functions)."""

    @staticmethod
    def forward(ctx, x, shape):
        ctx.shape = x.shape
        return x.new_empty(shape)

    @staticmethod
    def backward(ctx, grad):
        return grad.new_empty(ctx.shape), None


def _resize_dim(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = size
    return _Resize.apply(x, tuple(shape))


def _hidden(args, kwargs, names=("hidden_states",)) -> tuple[torch.Tensor | None, str | int | None]:
    if args and torch.is_tensor(args[0]) and args[0].dim() == 3 and args[0].is_floating_point():
        return args[0], 0
    for key in names:
        value = kwargs.get(key)
        if torch.is_tensor(value) and value.dim() == 3 and value.is_floating_point():
            return value, key
    return None, None


def _replace(args, kwargs, where, value):
    if where == 0:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, where: value}


class _SequenceState:
    """The whole sequence length of the current forward, and the replicated parameters found fed the chunk."""

    def __init__(self, tp: int):
        self.tp, self.whole = tp, None
        self.summed: dict[int, int] = {}       # id(parameter) -> elements (gradient summed over tp)


def _split_first(state: _SequenceState, module, args, kwargs):
    hidden, where = _hidden(args, kwargs)
    state.whole = hidden.shape[SEQ_DIM]
    return _replace(args, kwargs, where, _resize_dim(hidden, SEQ_DIM, state.whole // state.tp))


def _gather_last(state: _SequenceState, module, args, output):
    out = output if torch.is_tensor(output) else output[0]
    whole = _resize_dim(out, SEQ_DIM, state.whole)
    return whole if torch.is_tensor(output) else (whole, *output[1:])


def _gather_input(state: _SequenceState, names, module, args, kwargs):
    hidden, where = _hidden(args, kwargs, names)
    if hidden is None or hidden.shape[SEQ_DIM] == state.whole:
        return args, kwargs
    return _replace(args, kwargs, where, _resize_dim(hidden, SEQ_DIM, state.whole))


def _split_output(state: _SequenceState, module, args, output):
    out = output if torch.is_tensor(output) else output[0]
    if not torch.is_tensor(out) or out.dim() != 3 or out.shape[SEQ_DIM] != state.whole:
        return output
    local = _resize_dim(out, SEQ_DIM, state.whole // state.tp)
    return local if torch.is_tensor(output) else (local, *output[1:])


def _note_chunk(state: _SequenceState, params, module, args, kwargs):
    t = next((a for a in (*args, *kwargs.values()) if torch.is_tensor(a) and a.is_floating_point()), None)
    if t is not None and t.dim() > SEQ_DIM and state.whole and t.shape[SEQ_DIM] == state.whole // state.tp:
        state.summed.update({id(p): p.numel() for p in params})


def install_sequence_split(model: nn.Module, roles: SequenceRoles) -> _SequenceState:
    """Hooks that make `model` hold 1/tp of the sequence where split_gather does (see the module docstring);
    the returned state's `summed` fills in as the forward runs."""
    state = _SequenceState(roles.tp)
    layers = model.get_submodule(roles.stack)
    blocks = dict(roles.gather_blocks)
    linears = set(roles.gather_columns) | set(roles.split_rows)
    layers[0].register_forward_pre_hook(partial(_split_first, state), with_kwargs=True)
    layers[len(layers) - 1].register_forward_hook(partial(_gather_last, state))
    for layer in layers:
        for rel, module in layer.named_modules():
            if rel in blocks:
                module.register_forward_pre_hook(partial(_gather_input, state, blocks[rel]), with_kwargs=True)
                module.register_forward_hook(partial(_split_output, state))
            if rel in roles.gather_columns:
                module.register_forward_pre_hook(partial(_gather_input, state, ("input",)), with_kwargs=True)
            if rel in roles.split_rows:
                module.register_forward_hook(partial(_split_output, state))
                if getattr(module, "bias", None) is not None:       # added after the reduce-scatter
                    state.summed[id(module.bias)] = module.bias.numel()
            elif rel not in linears:
                params = [p for p in module.parameters(recurse=False) if p.requires_grad]
                if params:
                    module.register_forward_pre_hook(partial(_note_chunk, state, params), with_kwargs=True)
    return state


class _RowsExchange(torch.autograd.Function):
    """`comm.all_to_all` without its data: `all_to_all_single`'s buffers (the input made contiguous, a
    received tensor of the rows every rank sends here), forward and (the rows back) backward; saves nothing."""

    @staticmethod
    def forward(ctx, x, output_sizes, input_sizes):
        ctx.sizes = output_sizes, input_sizes
        return _received(x, output_sizes)

    @staticmethod
    def backward(ctx, grad):
        output_sizes, input_sizes = ctx.sizes
        return _received(grad, input_sizes), None, None


def _received(x: torch.Tensor, sizes) -> torch.Tensor:
    x = x.contiguous()
    return x.new_empty((sum(sizes), *x.shape[1:]))


def _along_first(x: torch.Tensor, dim: int, factor: float) -> torch.Tensor:
    """`comm.all_gather` (factor = group size) or `comm.reduce_scatter` (1 / size) along `dim` without
    the data: `dim` moved first and made contiguous, the output buffer, moved back and made contiguous."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((int(moved.shape[0] * factor), *moved.shape[1:]))
    return out.movedim(0, dim).contiguous()


class _GatherSequence(torch.autograd.Function):
    """`comm.gather_from_seq` without its data: all-gather's buffers forward, reduce-scatter's backward."""

    @staticmethod
    def forward(ctx, x, size, dim):
        ctx.size, ctx.dim = size, dim % x.dim()
        return _along_first(x, ctx.dim, size)

    @staticmethod
    def backward(ctx, grad):
        return _along_first(grad, ctx.dim, 1 / ctx.size), None, None


class _ShapeOnlyComm:
    """The collectives context-parallel attention calls (`UlyssesAttention.comm`) for the fake run of
    one rank of `size`: the real ones' shapes and buffers (what a step holds while they run: the send
    copy, the receive buffer, the contiguous result), no exchange."""

    def __init__(self, size: int):
        self.size = size

    def all_to_all(self, x, group, output_sizes, input_sizes):
        return _RowsExchange.apply(x, output_sizes, input_sizes)

    def gather_from_seq(self, x, group, dim: int = 1):
        return _GatherSequence.apply(x, self.size, dim)


def install_context(model: nn.Module, size: int, mode: str):
    """meshboost's context-parallel attention on `model`, its own code (the exchanges' reshapes and
    copies) with shape-only collectives (`_ShapeOnlyComm`), and the `ContextInputs` that cuts a batch
    into rank 0's piece (every rank holds as many tokens)."""
    from meshboost.shardformer.context import (
        ContextInputs,
        GatheredKeysAttention,
        UlyssesAttention,
        install,
    )
    from meshboost.shardformer.context_checks import ALL_TO_ALL

    inner = model.config._attn_implementation
    attention = (UlyssesAttention if mode == ALL_TO_ALL else GatheredKeysAttention)(None, size, inner)
    attention.comm = _ShapeOnlyComm(size)
    install(model, None, size, inner, mode, attention=attention)
    return ContextInputs(attention, 0, model)


class _LastTpRank:
    """`dist` as vocab.py's cross-entropy sees it on the fake run: this rank is the last of `tp` (the
    one whose vocabulary shard holds the padding columns, masked in a copy: the worst rank)."""

    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, tp: int):
        self.tp = tp

    def get_rank(self, group=None) -> int:
        return self.tp - 1


class _NoExchange:
    """comm as vocab.py's cross-entropy sees it on the fake run: its all-reduces leave the tensor
    (in place, saving nothing) as the real ones do, without a process group."""

    @staticmethod
    def all_reduce(tensor, group=None, op=None):
        return tensor


def install_vocab_parallel_loss(model: nn.Module, tp: int):
    """meshboost's vocab-parallel cross-entropy (`make_causal_lm_loss` on a head whose logits stay
    split: `vocab_parallel_cross_entropy`, its own autograd function) as the fake model's loss, its
    exchanges shape-only; a context manager: vocab.py's `dist` and `comm` are swapped while it is open.
    What it saves and the temporaries of its backward are the real layout's (one fp32 softmax, no
    log-softmax and its gradient as transformers' loss has)."""
    from contextlib import contextmanager

    from meshboost.shardformer.layers import vocab

    class _SplitHead:                      # what make_causal_lm_loss reads of the head
        output_is_parallel, process_group = True, None

    model.loss_function = vocab.make_causal_lm_loss(_SplitHead())

    @contextmanager
    def swapped():
        saved = vocab.dist, vocab.comm, vocab.check_in_range
        # the label check reads a fake tensor's value (it cannot): the labels are in range by construction
        vocab.dist, vocab.comm, vocab.check_in_range = _LastTpRank(tp), _NoExchange(), _no_check
        try:
            yield
        finally:
            vocab.dist, vocab.comm, vocab.check_in_range = saved

    return swapped()


def _no_check(values, bad, what) -> None:
    return None


def install_chunked_loss(model: nn.Module, chunk_tokens: int):
    """The sharder's chunked LM head and loss (`chunked_loss.install_chunked_loss`, the runtime's own) on the
    fake model; a context manager: the label check, which reads a fake tensor's values (it cannot), is
    swapped out while it is open (the labels are in range by construction). On a per-tp-rank config the head
    is the rank's vocabulary shard as a plain linear: its chunks' logits are the vocab-parallel head's; the
    two collectives' 3 x tokens fp32 are left out."""
    from contextlib import contextmanager

    from meshboost.shardformer.layers import chunked_loss

    chunked_loss.install_chunked_loss(model, chunk_tokens)

    @contextmanager
    def swapped():
        saved = chunked_loss.check_in_range
        chunked_loss.check_in_range = _no_check
        try:
            yield
        finally:
            chunked_loss.check_in_range = saved

    return swapped()
