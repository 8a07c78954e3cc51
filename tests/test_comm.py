"""Every collective of `meshboost.distributed.comm` (and the pipeline's loss broadcast) on strided views:
each input or output given as a view into a larger tensor (every other column, a transpose, an inner
block) gives bitwise the result of the same call on a contiguous copy, written into the view and nowhere
else in the tensor behind it, and a differentiable one's gradient too. gloo reads and writes a tensor's
storage as if it were contiguous, so an all-reduce of `t[:, ::2]` summed the wrong elements and said
nothing. A target whose elements share memory (`expand`) is refused on every rank, and the group goes on.
The removed shared-memory transport's keyword warns. Two gloo ranks, one process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from meshboost.distributed import comm
from meshboost.distributed.p2p import StageComm
from meshboost.testing import spawn

FILL = -7.0     # what the tensor behind a view holds outside it, on every rank
LAYOUTS = ("contiguous", "every other column", "transpose", "inner block")


def _view(values: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the tensor behind, a view of it holding `values`, 2-D) in `layout`."""
    rows, cols = values.shape
    if layout == "contiguous":
        base = values.clone()
        return base, base
    if layout == "every other column":
        base = torch.full((rows, 2 * cols), FILL)
        view = base[:, ::2]
    elif layout == "transpose":
        base = torch.full((cols, rows), FILL)
        view = base.t()
    else:
        base = torch.full((rows + 2, cols + 2), FILL)
        view = base[1:-1, 1:-1]
    assert layout == "contiguous" or not view.is_contiguous(), layout
    view.copy_(values)
    return base, view


def _flat_view(values: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D tensor's strided stand-in: every other element of a longer one."""
    if layout == "contiguous":
        base = values.clone()
        return base, base
    base = torch.full((2 * values.numel(),), FILL)
    base[::2] = values
    return base, base[::2]


def _values(rank: int, shape=(4, 6), salt: int = 0) -> torch.Tensor:
    """Each rank's own numbers, so a sum of the wrong elements shows."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + salt))


def _expect_written(base: torch.Tensor, view_of, result: torch.Tensor, where: str) -> None:
    """`base` holds `result` in the view `view_of(base)` and FILL (or its own values) everywhere else."""
    expected = base.clone()
    view_of(expected).copy_(result)
    assert torch.equal(base, expected), f"{where}: written outside the view or wrong inside it"


def _in_place(rank: int, group) -> None:
    """all_reduce (SUM, MAX, in place and out=), all_reduce_async, broadcast, broadcast_from_last."""
    stage = StageComm(group, torch.device("cpu"))
    for layout in LAYOUTS:
        for name in ("sum", "max", "out", "async", "broadcast", "broadcast_from_last"):
            where = f"{name} {layout}"
            values = _values(rank, salt=len(name))
            reference = values.clone()
            base, view = _view(values, layout)
            before = base.clone()
            if name == "sum":
                got = comm.all_reduce(view, group)
                comm.all_reduce(reference, group)
            elif name == "max":
                got = comm.all_reduce(view, group, op=dist.ReduceOp.MAX)
                comm.all_reduce(reference, group, op=dist.ReduceOp.MAX)
            elif name == "out":
                out_base, out = _view(torch.zeros(4, 6), layout)
                got = comm.all_reduce(view, group, out=out)
                comm.all_reduce(reference, group)
                assert got is out and torch.equal(base, before), f"{where}: the input changed"
                _expect_written(out_base, lambda t: _view_of(t, layout), reference, where)
                continue
            elif name == "async":
                got = comm.all_reduce_async(view, group).wait()
                comm.all_reduce(reference, group)
            elif name == "broadcast":
                got = comm.broadcast(view, 0, group)
                comm.broadcast(reference, 0, group)
            else:
                got = stage.broadcast_from_last(view)
                comm.broadcast(reference, 1, group)
            assert got is view, where
            _expect_written(base, lambda t: _view_of(t, layout), reference, where)


def _view_of(base: torch.Tensor, layout: str) -> torch.Tensor:
    """The view `_view` made of a tensor shaped like `base`."""
    return {"contiguous": lambda t: t, "every other column": lambda t: t[:, ::2], "transpose": lambda t: t.t(),
            "inner block": lambda t: t[1:-1, 1:-1]}[layout](base)


def _out_of_place(rank: int, group) -> None:
    """all_gather, reduce_scatter (and async), all_to_all_single (even and uneven) of strided inputs."""
    for layout in LAYOUTS:
        for dim in (0, -1):
            values = _values(rank, salt=dim + 5)
            _, view = _view(values, layout)
            cases = {"all_gather": lambda t: comm.all_gather(t, group, dim=dim),
                     "reduce_scatter": lambda t: comm.reduce_scatter(t, group, dim=dim),
                     "reduce_scatter_async": lambda t: comm.reduce_scatter_async(t, group, dim=dim).wait()}
            for name, call in cases.items():
                assert torch.equal(call(view), call(values.clone())), f"{name} dim={dim} {layout}"
        values = _values(rank, salt=9)
        _, view = _view(values, layout)
        assert torch.equal(comm.all_to_all_single(view, group), comm.all_to_all_single(values.clone(), group)), layout
        sizes = ([1, 3], [1, 1] if rank == 0 else [3, 3])     # rank 0 gets one row from each, rank 1 three
        got = comm.all_to_all_single(view, group, output_sizes=sizes[1], input_sizes=sizes[0])
        assert torch.equal(got, comm.all_to_all_single(values.clone(), group, sizes[1], sizes[0])), layout


def _flat(rank: int, group) -> None:
    """all_gather_into (a strided output, a strided shard, the shard a slice of the output) and
    gather_spans (a strided piece into a strided output)."""
    for layout in ("contiguous", "every other element"):
        shard = _values(rank, (5,), salt=11)
        reference = torch.empty(10)
        comm.all_gather_into(reference, shard.clone(), group)
        out_base, out = _flat_view(torch.zeros(10), layout)
        _, shard_view = _flat_view(shard, layout)
        assert comm.all_gather_into(out, shard_view, group) is out
        _expect_written(out_base, lambda t: t if layout == "contiguous" else t[::2], reference, f"gather {layout}")
        # ZeRO's form: the shard is this rank's own slice of the output
        out_base, out = _flat_view(torch.zeros(10), layout)
        out[5 * rank:5 * rank + 5] = shard
        comm.all_gather_into(out, out[5 * rank:5 * rank + 5], group)
        _expect_written(out_base, lambda t: t if layout == "contiguous" else t[::2], reference, f"own {layout}")
        spans = [(0, 3), (3, 7)]
        piece = _values(rank, (spans[rank][1] - spans[rank][0],), salt=13)
        _, piece_view = _flat_view(piece, layout)
        reference = comm.gather_spans(piece.clone(), spans, group, dst=0)
        out_base, out = _flat_view(torch.zeros(7), layout)
        got = comm.gather_spans(piece_view, spans, group, dst=0, out=out)
        if rank == 0:
            assert got is out
            _expect_written(out_base, lambda t: t if layout == "contiguous" else t[::2], reference,
                            f"gather_spans {layout}")
        else:
            assert got is None and reference is None


def _differentiable(rank: int, group) -> None:
    """Each region transition: forward and input gradient of a strided input, under a strided upstream
    gradient, equal those of a contiguous copy (and the tensor behind gets no gradient outside the view)."""
    sizes = [2, 2]
    functions = {
        "copy_to_tp": lambda x: comm.copy_to_tp(x, group),
        "reduce_from_tp": lambda x: comm.reduce_from_tp(x, group),
        "split_to_tp": lambda x: comm.split_to_tp(x, group, dim=-1),
        "gather_from_tp": lambda x: comm.gather_from_tp(x, group, dim=-1),
        "gather_from_seq": lambda x: comm.gather_from_seq(x, group, dim=0),
        "reduce_scatter_to_seq": lambda x: comm.reduce_scatter_to_seq(x, group, dim=0),
        "all_to_all": lambda x: comm.all_to_all(x, group, sizes, sizes),
    }
    for layout in LAYOUTS:
        for name, function in functions.items():
            where = f"{name} {layout}"
            base, view = _view(_values(rank, salt=17), layout)
            base.requires_grad_(True)
            x = _view_of(base, layout)
            contiguous = view.detach().clone().requires_grad_(True)
            y, y_ref = function(x), function(contiguous)
            assert torch.equal(y, y_ref), f"{where}: forward"
            gradient = _values(rank, tuple(y.shape), salt=19)
            y.backward(_view(gradient, layout)[1])
            y_ref.backward(gradient)
            expected = torch.zeros_like(base)
            _view_of(expected, layout).copy_(contiguous.grad)
            assert torch.equal(base.grad, expected), f"{where}: input gradient"


def _sibling_gradient(rank: int, group) -> None:
    """copy_to_tp's backward sums the tp gradient out of place: a sibling branch that receives the same
    upstream gradient buffer (y = r + f(x), r = w * x) keeps its own gradient (an in-place sum doubled w's)."""
    w = torch.ones(3, requires_grad=True)
    x = torch.full((3,), float(rank + 1))
    y = w * x + comm.copy_to_tp(w * x, group)
    gradient = torch.ones(3)
    y.backward(gradient)
    # d/dw of w*x (this rank's own branch, summed nowhere) + the all-reduced d/dw through f: x + sum of ones * x
    assert torch.equal(w.grad, x + 2 * x), (rank, w.grad)
    assert torch.equal(gradient, torch.ones(3)), "the upstream gradient was changed in place"


def _values_of_graph_tensors(rank: int, group) -> None:
    """The raw collectives move values: a tensor that requires grad (eval-mode logits under grad mode, as
    cp's combine gathers them) gives the same result as its detached copy (gloo refused it on its own thread)."""
    for layout in ("contiguous", "transpose"):
        base = _values(rank, salt=23).requires_grad_(True)
        x = _view_of(base * 1, layout)                       # a non-leaf view inside a graph
        plain = x.detach().clone()
        calls = {"all_gather": lambda t: comm.all_gather(t, group, dim=1),
                 "reduce_scatter": lambda t: comm.reduce_scatter(t, group, dim=0),
                 "all_to_all_single": lambda t: comm.all_to_all_single(t, group),
                 "all_reduce out=": lambda t: comm.all_reduce(t, group, out=torch.empty(tuple(t.shape)))}
        for name, call in calls.items():
            got = call(x)
            assert not got.requires_grad and torch.equal(got, call(plain)), f"{name} {layout}"
        flat = torch.empty(2 * base.numel())
        comm.all_gather_into(flat, base.reshape(-1) * 1, group)
        assert torch.equal(flat, comm.all_gather(plain.reshape(-1) if layout == "contiguous"
                                                 else _values(rank, salt=23).reshape(-1), group, dim=0)), layout


def _refused(rank: int, group) -> None:
    """A target whose elements share memory cannot hold one sum per element: refused before any
    communication, on every rank, and the next collective runs."""
    shared = torch.ones(1, 6).expand(4, 6)
    for call in (lambda: comm.all_reduce(shared, group), lambda: comm.all_reduce_async(shared, group),
                 lambda: comm.broadcast(shared, 0, group), lambda: comm.all_reduce(torch.ones(4, 6), group, out=shared)):
        with pytest.raises(ValueError, match=r"shape \(4, 6\) and strides \(0, 1\).*share memory.*clone"):
            call()
    assert torch.equal(comm.all_reduce(torch.ones(3), group), torch.full((3,), 2.0))


def _old_keyword(rank: int) -> None:
    """`launch(cpu_shared_memory=...)` (the removed CPU transport's switch) still starts, with a warning that
    it does nothing, for one release."""
    from meshboost.distributed.launch import launch
    with pytest.warns(FutureWarning, match=r"cpu_shared_memory=\.\.\.\) is ignored.*drop the argument"):
        launch(rank, 2, "127.0.0.1", 0, cpu_shared_memory=False)      # the group exists: nothing restarts


def _body(rank: int, world: int) -> None:
    group = dist.group.WORLD
    _old_keyword(rank)
    _in_place(rank, group)
    _out_of_place(rank, group)
    _flat(rank, group)
    _differentiable(rank, group)
    _sibling_gradient(rank, group)
    _values_of_graph_tensors(rank, group)
    _refused(rank, group)


def test_collectives_on_strided_views_equal_the_contiguous_call():
    spawn(_body, 2)
