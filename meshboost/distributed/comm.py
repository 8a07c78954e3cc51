"""Every collective meshboost issues, and each differentiable one paired with its backward twin.

Owns: the raw collectives (which also feed `meshboost.distributed.profiling`) and one autograd Function per
region transition, named forward->backward as in Megatron's mappings:

    copy_to_tp          identity    -> all-reduce   (Megatron "f": input of a column-parallel block)
    reduce_from_tp      all-reduce  -> identity     (Megatron "g": output of a row-parallel linear)
    split_to_tp         split       -> all-gather   (last dim)
    gather_from_tp      all-gather  -> split        (last dim)
    gather_from_seq     all-gather  -> reduce-scatter (sequence parallelism, `dim`)
    reduce_scatter_to_seq reduce-scatter -> all-gather (sequence parallelism, `dim`)
    all_to_all          all-to-all  -> all-to-all back (expert parallelism's dispatch and combine, uneven)

Every function takes its `group` explicitly; None means torch's default group (the world), as
in torch.distributed. Layers, optimizers and checkpoints call these and contain no `dist.*`
collectives. A group of size 1 (or no process group) makes every function the identity.

Any strided input or output is fine: the backends read and write a tensor's storage as if it were
contiguous (gloo's all-reduce of `t[:, ::2]` sums elements outside the view and says nothing; NCCL
refuses it), so what reaches them is always a contiguous tensor, copied from and back into a view where
needed. The raw collectives move values only: they read their inputs detached (gloo copies into views of
its output on its own thread, where a tensor that requires grad is refused), and the autograd Functions
below carry the gradients.
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist

from meshboost.distributed.launch import TIMEOUT_ENV, group_timeout
from meshboost.distributed.profiling import record_collective, record_wait, timing_waits

# torch >= 2.10 renamed the single-tensor collectives; keep working on older releases too.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process group's timeout: a peer stalled, died, or
    runs different code (a different configuration, a different number of steps)."""


def run_collective(op: str, group, call):
    """Run `call()`, turning the backend's timeout error into a `CollectiveTimeout` that says which
    collective over which ranks, and how to change the timeout. The time it blocks the caller goes to
    the active wait timers (profiling.wait_timer)."""
    start = time.perf_counter() if timing_waits() else None
    try:
        out = call()
        if start is not None:
            record_wait(time.perf_counter() - start)
        return out
    except RuntimeError as e:
        if "timed out" not in str(e).lower() and "timeout" not in str(e).lower():
            raise
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        raise CollectiveTimeout(
            f"{op} over ranks {ranks} did not complete within {group_timeout(group)}: a peer stalled, crashed or "
            f"runs different code (check every rank's log). Raise the limit with "
            f"launch_from_torch(timeout=...) or {TIMEOUT_ENV}=<seconds>. Backend error: {e}") from e


# -- raw collectives (not differentiable) -----------------------------------------------------
def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` itself when contiguous, else a contiguous copy: the only layout a backend reads right."""
    tensor = tensor.detach()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _writable(target: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous tensor a backend may write `target`'s result into, holding `values` when given:
    `target` itself when contiguous, else a new one (`_landed` copies it back). A target whose elements
    share memory (an `expand`ed view) cannot hold one result per element: refused on every rank that
    passes one, before any communication."""
    buffer = target
    if not target.is_contiguous():
        if any(stride == 0 and size > 1 for size, stride in zip(target.shape, target.stride())):
            raise ValueError(f"a collective cannot write into a tensor of shape {tuple(target.shape)} and strides "
                             f"{target.stride()}: its elements share memory (an expand()ed view); pass a .clone()")
        buffer = torch.empty_like(target, memory_format=torch.contiguous_format)
    if values is not None and values is not buffer:
        buffer.copy_(values.detach())
    return buffer


def _landed(target: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """`target` holding what a collective wrote into `buffer` (its `_writable` stand-in)."""
    return target if buffer is target else target.copy_(buffer)


def all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM, out: torch.Tensor | None = None) -> torch.Tensor:
    """All-reduce of `tensor` over `group`, in place, or into `out` (a tensor of its shape; `tensor`
    unchanged); returns the result. Either may be a strided view."""
    target = tensor if out is None else out
    if dist.get_world_size(group) == 1:
        return target if out is None else out.copy_(tensor)
    buffer = _writable(target, tensor)
    record_collective("all_reduce", group, buffer)
    run_collective("all_reduce", group, lambda: _all_reduce(buffer, group, op))
    return _landed(target, buffer)


def _all_reduce(tensor: torch.Tensor, group, op, async_op: bool = False):
    """The backend's all-reduce of a contiguous `tensor`, in place (its work handle when `async_op`): the
    one transport call of every all-reduce here (benchmarks/comm_floor.py replaces it to time a step with
    free communication)."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's `tensor` along `dim` (rank order)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    dim = dim % tensor.dim()
    moved = tensor.detach().movedim(dim, 0).contiguous()
    out = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    record_collective("all_gather", group, out)
    run_collective("all_gather", group, lambda: _all_gather_single(out, moved, group=group))
    return out.movedim(0, dim).contiguous()


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group) -> torch.Tensor:
    """Flat all-gather into `out` (every rank's `shard`, rank order, concatenated), in place: `shard`
    may be this rank's own slice of `out` (ZeRO's owned part of a bucket of weights), so nothing is
    allocated when both are contiguous. Returns `out`."""
    if dist.get_world_size(group) == 1:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return out
    shard, buffer = _dense(shard), _writable(out)
    record_collective("all_gather", group, buffer)
    run_collective("all_gather", group, lambda: _all_gather_single(buffer, shard, group=group))
    return _landed(out, buffer)


def broadcast(tensor: torch.Tensor, src: int, group) -> torch.Tensor:
    """`tensor` of global rank `src` on every rank of `group`, in place (a strided view too); returns it."""
    if dist.get_world_size(group) == 1:
        return tensor
    buffer = _writable(tensor, tensor)
    record_collective("broadcast", group, buffer)
    run_collective("broadcast", group, lambda: dist.broadcast(buffer, src=src, group=group))
    return _landed(tensor, buffer)


def _scatter_buffers(tensor: torch.Tensor, size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input with `dim` moved first, output buffer) of a reduce-scatter over `size` ranks along `dim`."""
    if tensor.shape[dim] % size:
        raise ValueError(f"reduce_scatter: dim {dim} of size {tensor.shape[dim]} is not divisible by "
                         f"the group size {size}")
    moved = tensor.detach().movedim(dim, 0).contiguous()
    return moved, torch.empty((moved.shape[0] // size, *moved.shape[1:]), dtype=tensor.dtype, device=tensor.device)


def reduce_scatter(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Sum `tensor` over ranks and keep this rank's chunk along `dim`."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    dim = dim % tensor.dim()
    moved, out = _scatter_buffers(tensor, size, dim)
    record_collective("reduce_scatter", group, moved)
    run_collective("reduce_scatter", group, lambda: _reduce_scatter_single(out, moved, group=group))
    return out.movedim(0, dim).contiguous()


class Pending:
    """An asynchronous collective in flight: `wait()` blocks until it is done and returns its result.
    Issue it, do independent work, and wait only where the result is used (overlap)."""

    def __init__(self, op: str, group, work, finish):
        self.op, self.group, self._work, self._finish = op, group, work, finish
        self._started = time.perf_counter() if work is not None and timing_waits() else None

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            if self._started is not None:       # in flight behind the caller's work until now
                record_wait(0.0, time.perf_counter() - self._started)
            run_collective(self.op, self.group, self._work.wait)
            self._work = None
        return self._finish()


def all_reduce_async(tensor: torch.Tensor, group) -> Pending:
    """In-place all-reduce of `tensor` over `group`, started now; `wait()` returns it (a strided view is
    written at `wait()`)."""
    if dist.get_world_size(group) == 1:
        return Pending("all_reduce", group, None, lambda: tensor)
    buffer = _writable(tensor, tensor)
    record_collective("all_reduce", group, buffer)
    work = run_collective("all_reduce", group, lambda: _all_reduce(buffer, group, dist.ReduceOp.SUM, async_op=True))
    return Pending("all_reduce", group, work, lambda: _landed(tensor, buffer))


def reduce_scatter_async(tensor: torch.Tensor, group, dim: int = -1) -> Pending:
    """`reduce_scatter` (sum over ranks, this rank's chunk along `dim`), started now; `wait()` returns it."""
    size = dist.get_world_size(group)
    if size == 1:
        return Pending("reduce_scatter", group, None, lambda: tensor)
    dim = dim % tensor.dim()
    moved, out = _scatter_buffers(tensor, size, dim)
    record_collective("reduce_scatter", group, moved)
    work = run_collective("reduce_scatter", group,
                          lambda: _reduce_scatter_single(out, moved, group=group, async_op=True))
    return Pending("reduce_scatter", group, work, lambda: out.movedim(0, dim).contiguous())


def gather_spans(piece: torch.Tensor, spans: list[tuple[int, int]], group, dst: int = 0,
                 out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Assemble a flat tensor whose elements [a_r, b_r) = spans[r] live on group rank r (`piece`,
    b_r - a_r elements, possibly none) on group rank `dst` only: each owner sends its span straight
    into its place in `out` (allocated when None), so no rank holds padding or a copy of another
    rank's part. Returns `out` on `dst`, None elsewhere. Spans may differ in size, unlike a gather."""
    size = dist.get_world_size(group)
    me = dist.get_group_rank(group, dist.get_rank()) if size > 1 else 0
    if me != dst:
        if piece.numel():
            record_collective("send", group, piece)
            run_collective("send", group,
                           lambda: dist.send(piece.detach().contiguous(), dst=dist.get_global_rank(group, dst), group=group))
        return None
    if out is None:
        out = torch.empty(max(b for _, b in spans), dtype=piece.dtype, device=piece.device)
    for r, (a, b) in enumerate(spans):
        if r == me:
            out[a:b] = piece
        elif b > a:
            src = dist.get_global_rank(group, r)
            buffer = _writable(out[a:b])
            run_collective("recv", group, lambda: dist.recv(buffer, src=src, group=group))
            _landed(out[a:b], buffer)
    return out


def all_to_all_single(tensor: torch.Tensor, group, output_sizes: list[int] | None = None,
                      input_sizes: list[int] | None = None) -> torch.Tensor:
    """Rows [sum(input_sizes[:r]), ...) of `tensor` to rank r of `group`; returns the rows every rank
    sent here, in rank order (`output_sizes[r]` from rank r). None: equal splits. Uneven and empty
    splits are fine (gloo and NCCL)."""
    if dist.get_world_size(group) == 1:
        return tensor
    tensor = tensor.detach().contiguous()
    rows = sum(output_sizes) if output_sizes is not None else tensor.shape[0]
    out = tensor.new_empty((rows, *tensor.shape[1:]))
    record_collective("all_to_all", group, tensor)
    run_collective("all_to_all", group, lambda: dist.all_to_all_single(
        out, tensor, output_split_sizes=output_sizes, input_split_sizes=input_sizes, group=group))
    return out


def all_reduce_grads(params: list, group, average: bool) -> None:
    """All-reduce (average=True: average) the gradients of `params` over `group` in place, one flat
    buffer per dtype. Every rank of `group` must hold gradients for the same parameters."""
    if group is None or dist.get_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    seen: set[int] = set()
    for p in params:
        if p.grad is not None and id(p) not in seen:
            seen.add(id(p))
            # an FSDP2 gradient (a DTensor shard, zero_stage=3 with pp ties): its local piece, laid out alike on
            # every rank of `group` (the same parameter, sharded over the same dp size)
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            by_dtype[grad.dtype].append(grad)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, group)
        if average:
            flat.div_(dist.get_world_size(group))
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def split(tensor: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """This rank's contiguous chunk of `tensor` along `dim` (no communication)."""
    size = dist.get_world_size(group)
    if size == 1:
        return tensor
    if tensor.shape[dim] % size:
        raise ValueError(f"split: dim {dim} of size {tensor.shape[dim]} is not divisible by the "
                         f"group size {size}")
    return tensor.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


# -- differentiable region transitions --------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # out of place: autograd may hand the same gradient buffer to another consumer (x + f(x))
        return all_reduce(grad, ctx.group, out=torch.empty_like(grad, memory_format=torch.contiguous_format)), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        return all_reduce(x, group, out=torch.empty_like(x))      # out of place: x may be saved for backward

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_sizes, input_sizes):
        ctx.group, ctx.sizes = group, (output_sizes, input_sizes)
        return all_to_all_single(x, group, output_sizes, input_sizes)

    @staticmethod
    def backward(ctx, grad):
        output_sizes, input_sizes = ctx.sizes          # the rows go back where they came from
        return all_to_all_single(grad, ctx.group, input_sizes, output_sizes), None, None, None


def _dim_mapping(name: str, forward_op, backward_op) -> type[torch.autograd.Function]:
    """An autograd function along a tensor dim: `forward_op` forward, `backward_op` on its gradient
    (Megatron's conjugate pairs: split / all-gather, all-gather / reduce-scatter, ...)."""
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return forward_op(x, group, dim)

    def backward(ctx, grad):
        return backward_op(grad, ctx.group, ctx.dim), None, None

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


_SplitToTP = _dim_mapping("_SplitToTP", split, all_gather)
_GatherFromTP = _dim_mapping("_GatherFromTP", all_gather, split)
_GatherFromSeq = _dim_mapping("_GatherFromSeq", all_gather, reduce_scatter)           # sequence parallelism
_ReduceScatterToSeq = _dim_mapping("_ReduceScatterToSeq", reduce_scatter, all_gather)


def _trivial(group) -> bool:
    """No communication needed: a group of one (None is torch's default group, as everywhere in
    torch.distributed), or no process group at all."""
    return not dist.is_initialized() or dist.get_world_size(group) == 1


def is_parallel(group) -> bool:
    """True when `group` has more than one rank (collectives over it communicate)."""
    return not _trivial(group)


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (Megatron f)."""
    return x if _trivial(group) else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron g)."""
    return x if _trivial(group) else _ReduceFromTP.apply(x, group)


def split_to_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """Keep this rank's chunk forward, all-gather the gradient backward."""
    return x if _trivial(group) else _SplitToTP.apply(x, group, dim)


def gather_from_tp(x: torch.Tensor, group, dim: int = -1) -> torch.Tensor:
    """All-gather forward, keep this rank's chunk of the gradient backward."""
    return x if _trivial(group) else _GatherFromTP.apply(x, group, dim)


def gather_from_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """All-gather the sequence forward, reduce-scatter the gradient backward (sequence parallel)."""
    return x if _trivial(group) else _GatherFromSeq.apply(x, group, dim)


def reduce_scatter_to_seq(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """Reduce-scatter partial sums over the sequence forward, all-gather backward (sequence parallel)."""
    return x if _trivial(group) else _ReduceScatterToSeq.apply(x, group, dim)


def all_to_all(x: torch.Tensor, group, output_sizes: list[int], input_sizes: list[int]) -> torch.Tensor:
    """`all_to_all_single` forward, the reverse exchange of the gradient backward: every rank that
    sent rows gets their gradients back, so a rank that received none still joins the backward."""
    return x if _trivial(group) else _AllToAll.apply(x, group, output_sizes, input_sizes)
