"""The same-host shared-memory collectives (`meshboost.distributed.shm`), which `comm.py`'s all-reduce,
all-gather and reduce-scatter take for CPU tensors between ranks of one machine. On 2 processes: bitwise
gloo's result for every reduction, dtype and size they take (tensors larger than one slot included, in
chunks; the all-gather of any dtype, along a middle dim and in place as ZeRO gathers its buckets); counted
once by meshboost's counter and once by the dispatcher witness, with nothing written to a socket; inf and
nan propagate; tensors of different sizes, dtypes, reductions or collectives on different ranks are refused
on every rank and the group goes on; a segment one rank cannot make leaves the group on gloo on every rank;
a stalled peer raises CollectiveTimeout after the group's timeout, and one whose process exited is reported
at once; `launch(cpu_shared_memory=False)` (here `shm.configure(False)`) puts the traffic back on gloo's
sockets; an asynchronous all-reduce or reduce-scatter of one round is published at issue and read at
wait() (a late peer does not hold the issuing rank), also when a later collective reads it first; an
out-of-place all-reduce leaves its input alone. On 3 processes: every rank gets bitwise the same sum, the
rank-order sum (r0 + r1) + r2 (in and out of place, one chunk and two), and the reduce-scatter and
all-gather agree with it. Another backend (torch's fake group) keeps its collectives."""

from __future__ import annotations

import datetime
import time

import pytest
import torch
import torch.distributed as dist

from meshboost.distributed import comm, comm_counter, shm
from meshboost.distributed.comm import CollectiveTimeout
from meshboost.distributed.launch import resolve_cpu_shared_memory
from meshboost.distributed.profiling import dispatched_comm_counter, wire_bytes
from meshboost.testing import spawn

OPS = (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)


def _inputs(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return (torch.randn(numel, generator=g) * 50).to(dtype)


def _two_ranks(rank, world):
    world_group = dist.group.WORLD
    comm.all_reduce(torch.ones(1), world_group)
    assert shm._segments.get(world_group) is not None, "two ranks of one host did not get a shared segment"

    # bitwise gloo's result: every op, dtype and size (one more than a slot holds: two chunks)
    big = shm.SLOT_BYTES // 4 + 7
    for numel in (0, 1, 1000, big):
        for dtype in (torch.float32, torch.float16, torch.float64, torch.int64):
            for op in OPS:
                if numel == big and (dtype != torch.float32 or op != dist.ReduceOp.SUM):
                    continue
                x = _inputs(rank, numel, dtype)
                expected = x.clone()
                dist.all_reduce(expected, op=op)                 # gloo's sockets
                assert comm.all_reduce(x, world_group, op) is x
                assert torch.equal(x, expected), f"{numel} {dtype} {op}: {(x.double() - expected.double()).abs().max()}"

    # all-gather (any dtype: bytes) and sum-reduce-scatter, along a middle dim and flat in place, bitwise gloo's
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool):
        x = _inputs(rank, 3 * 4 * 5, torch.float32).view(3, 4, 5).to(dtype)
        expected = torch.cat([_inputs(r, 3 * 4 * 5, torch.float32).view(3, 4, 5).to(dtype) for r in range(world)], 1)
        assert torch.equal(comm.all_gather(x, world_group, dim=1), expected), dtype
    for numel in (0, 6, big):
        flat = torch.zeros(world * numel)
        mine = flat[rank * numel:(rank + 1) * numel]
        mine.copy_(_inputs(rank, numel, torch.float32))
        comm.all_gather_into(flat, mine, world_group)
        assert torch.equal(flat, torch.cat([_inputs(r, numel, torch.float32) for r in range(world)])), numel
    for dtype, numel, dim in ((torch.float32, 4 * 6, 1), (torch.float16, 4 * 6, 0), (torch.float64, 2 * big, 0)):
        x = _inputs(rank, numel, dtype).view(4, -1) if numel < big else _inputs(rank, numel, dtype)
        dim = dim if x.dim() > 1 else 0
        moved = x.movedim(dim, 0).contiguous()
        expected = torch.empty((moved.shape[0] // world, *moved.shape[1:]), dtype=dtype)
        dist.reduce_scatter_tensor(expected, moved)                     # gloo's sockets
        got = comm.reduce_scatter(x, world_group, dim=dim)
        assert torch.equal(got, expected.movedim(0, dim)), (dtype, numel, dim)
        assert torch.equal(comm.reduce_scatter_async(x, world_group, dim=dim).wait(), got)
    # a rank calling another collective: refused on both
    with pytest.raises(ValueError, match="ranks passed different tensors or collectives"):
        if rank:
            comm.all_reduce(torch.ones(2), world_group)
        else:
            comm.all_gather(torch.ones(1), world_group, dim=0)

    # counted once by meshboost and once by the witness; nothing on the sockets
    x = _inputs(rank, 4096, torch.float32)
    before = wire_bytes()
    with comm_counter() as counted, dispatched_comm_counter() as witness:
        comm.all_reduce(x, world_group)
        comm.all_gather(x, world_group)
        comm.reduce_scatter(x, world_group)
    moved = wire_bytes() - before
    assert counted.summary() == witness.summary(), (counted.summary(), witness.summary())
    assert counted.summary()["world"]["by_op"] == {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}
    assert counted.summary()["world"]["payload_bytes"] == 4096 * 4 * (1 + world + 1)
    assert moved < 4096, f"{moved} bytes written to sockets by a shared-memory all-reduce"

    # out of place: the sum lands in `out`, the input is untouched; bitwise the in-place result (one chunk and two)
    for numel in (1000, big):
        x = _inputs(rank, numel, torch.float32)
        expected = x.clone()
        dist.all_reduce(expected)
        out = torch.empty_like(x)
        assert comm.all_reduce(x, world_group, out=out) is out
        assert torch.equal(out, expected) and torch.equal(x, _inputs(rank, numel, torch.float32)), numel

    _split_rounds(rank, world_group, big)

    # an fp16 overflow stays inf and a nan stays nan (the loss scaler reads them)
    z = torch.tensor([60000.0, 1.0, float("nan") if rank else 0.0], dtype=torch.float16)
    comm.all_reduce(z, world_group)
    assert z[0].isinf() and z[1] == 2 and z[2].isnan(), z

    # dtypes numpy cannot add (bfloat16) and reductions it has no ufunc for keep gloo, and stay right
    b = torch.full((5,), 1.5 + rank, dtype=torch.bfloat16)
    assert not shm.usable(b, dist.ReduceOp.SUM)
    assert torch.equal(comm.all_reduce(b, world_group), torch.full((5,), 4.0, dtype=torch.bfloat16))

    # different sizes on different ranks: refused on every rank, and the group goes on
    sizes = r"\[\(40, 40, 10000\), \(48, 48, 10000\)\]"          # (chunk bytes, tensor bytes, kind) by rank
    with pytest.raises(ValueError, match=rf"ranks passed different tensors or collectives .*{sizes}"):
        comm.all_reduce(torch.ones(10 + 2 * rank), world_group)
    # one chunk alike, the rest not: refused in the first chunk, not matched with the next call
    with pytest.raises(ValueError, match="ranks passed different tensors or collectives"):
        comm.all_reduce(torch.ones(shm.SLOT_BYTES // 4 + rank), world_group)
    # the same bytes as another dtype or op
    with pytest.raises(ValueError, match="ranks passed different tensors or collectives"):
        comm.all_reduce(torch.ones(4, dtype=torch.float32 if rank else torch.int32), world_group)
    with pytest.raises(ValueError, match="ranks passed different tensors or collectives"):
        comm.all_reduce(torch.ones(4), world_group, dist.ReduceOp.SUM if rank else dist.ReduceOp.MAX)
    assert comm.all_reduce(torch.ones(3), world_group).tolist() == [2.0, 2.0, 2.0]

    # switched off: gloo's sockets carry it
    assert shm.configure(False) is True                         # the previous setting comes back
    try:
        before = wire_bytes()
        assert comm.all_reduce(torch.ones(4096), world_group)[0] == 2
        assert wire_bytes() - before >= 4096 * 4, "with shared memory off the payload must cross the sockets"
    finally:
        shm.configure(True)

    # a segment that cannot be made (here: rank 0's directory is not one; in Docker, a full /dev/shm): the
    # ranks agree to keep gloo for that group, and its all-reduces stay right
    fallback = dist.new_group([0, 1])
    shm_dir = shm._SHM_DIR
    shm._SHM_DIR = "/dev/null" if rank == 0 else shm_dir
    try:
        assert comm.all_reduce(torch.ones(3), fallback).tolist() == [2.0, 2.0, 2.0]
    finally:
        shm._SHM_DIR = shm_dir
    assert shm._segments.get(fallback, "unset") is None, "a group whose segment failed must keep gloo"

    # a stalled peer: the waiting rank raises CollectiveTimeout after the group's own timeout
    seconds = 2
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=seconds))
    comm.all_reduce(torch.ones(1), short)                       # both ranks set the group up together
    assert shm._segments.get(short) is not None
    if rank == 1:
        time.sleep(seconds + 3)
    else:
        start = time.perf_counter()
        waited = r"all_reduce over ranks \[0, 1\] did not complete.*group ranks \[1\]"
        with pytest.raises(CollectiveTimeout, match=waited):
            comm.all_reduce(torch.ones(1), short)
        assert seconds <= time.perf_counter() - start < seconds + 2.5
    dist.barrier()

    # a peer whose process has exited: reported at once, not after the group's timeout
    patient = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=60))
    comm.all_reduce(torch.ones(1), patient)
    if rank == 1:
        return                                                  # this process leaves
    start = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"group rank 1 \(pid \d+\) exited"):
        comm.all_reduce(torch.ones(1), patient)
    assert time.perf_counter() - start < 30


def _split_rounds(rank, world_group, big):
    """An asynchronous all-reduce or reduce-scatter that fits one round is published at issue and read at
    wait(): the publisher goes on while a peer is late, and the result is the synchronous one."""
    y = _inputs(rank, 300, torch.float32)
    expected = y.clone()
    dist.all_reduce(expected)
    if rank == 1:
        time.sleep(1.5)                         # the peer is late (margins wide enough for a loaded machine)
    start = time.perf_counter()
    pending = comm.all_reduce_async(y, world_group)
    issued = time.perf_counter() - start
    assert torch.equal(pending.wait(), expected)
    if rank == 0:
        assert issued < 0.75 < time.perf_counter() - start, (issued, "issuing must not wait for the late peer")
    # a round nobody waited for is read by the group's next collective first (the two-buffer rule)
    y, z = _inputs(rank, 300, torch.float32), _inputs(rank, 40, torch.float32)
    first = comm.all_reduce_async(y, world_group)
    second = comm.reduce_scatter_async(z.view(4, 10), world_group, dim=0)
    third = comm.all_reduce_async(y * 0 + 1, world_group)
    assert torch.equal(third.wait(), torch.full((300,), 2.0))
    assert torch.equal(first.wait(), expected)
    assert torch.equal(second.wait(), comm.reduce_scatter(z.view(4, 10), world_group, dim=0))
    # larger than one slot: done on return, as the synchronous call
    x = _inputs(rank, big, torch.float32)
    expected = x.clone()
    dist.all_reduce(expected)
    assert torch.equal(comm.all_reduce_async(x, world_group).wait(), expected)
    # refused at wait() on every rank when the ranks published different sizes, and the group goes on
    with pytest.raises(ValueError, match="ranks passed different tensors or collectives"):
        comm.all_reduce_async(torch.ones(10 + rank), world_group).wait()
    assert torch.equal(comm.all_reduce(torch.ones(3), world_group), torch.full((3,), 2.0))


def _three_ranks(rank, world):
    x = _inputs(rank, 1001, torch.float32)
    inputs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(inputs, x)
    out = comm.all_reduce(x, dist.group.WORLD, out=torch.empty_like(x))         # out of place, then in place
    comm.all_reduce(x, dist.group.WORLD)
    assert shm._segments.get(dist.group.WORLD) is not None
    assert torch.equal(x, (inputs[0] + inputs[1]) + inputs[2]), "not the rank-order sum"
    assert torch.equal(out, x)
    big = _inputs(rank, shm.SLOT_BYTES // 4 + 7, torch.float32)                 # two chunks, in place
    whole = [torch.empty_like(big) for _ in range(world)]
    dist.all_gather(whole, big)
    assert torch.equal(comm.all_reduce(big, dist.group.WORLD), (whole[0] + whole[1]) + whole[2])
    assert torch.equal(comm.all_reduce_async(inputs[rank].clone(), dist.group.WORLD).wait(), out), "one round, later"
    results = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(results, x)
    assert all(torch.equal(r, results[0]) for r in results), "ranks got different sums"
    # reduce-scatter: my part of the rank-order sum; all-gather: every rank's part in rank order
    part = comm.reduce_scatter(inputs[rank][:999], dist.group.WORLD, dim=0)
    mine = slice(rank * 333, (rank + 1) * 333)
    assert torch.equal(part, (inputs[0][:999][mine] + inputs[1][:999][mine]) + inputs[2][:999][mine])
    assert torch.equal(comm.all_gather(inputs[rank], dist.group.WORLD, dim=0), torch.cat(inputs))


def test_shared_memory_all_reduce_is_gloos_on_two_ranks():
    spawn(_two_ranks, 2)


def test_shared_memory_all_reduce_agrees_on_three_ranks():
    spawn(_three_ranks, 3)


def test_other_backends_keep_their_collectives():
    """A group on another backend (here torch's fake one, whose collectives do nothing) never takes shared
    memory: its collectives stay the backend's, with no set-up exchange that could wait for absent peers."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        x = torch.ones(3)
        comm.all_reduce(x, None)
        assert comm.all_gather(x, None, dim=0).shape == (6,)
        assert shm._segments.get(dist.group.WORLD, "unset") is None
    finally:
        dist.destroy_process_group()


def test_switch_values_are_checked(monkeypatch):
    monkeypatch.delenv("MESHBOOST_CPU_SHM", raising=False)
    assert resolve_cpu_shared_memory(None) is True and resolve_cpu_shared_memory(False) is False
    monkeypatch.setenv("MESHBOOST_CPU_SHM", "0")
    assert resolve_cpu_shared_memory(None) is False and resolve_cpu_shared_memory(True) is True
    monkeypatch.setenv("MESHBOOST_CPU_SHM", "off")
    with pytest.raises(ValueError, match="MESHBOOST_CPU_SHM='off': expected 0"):
        resolve_cpu_shared_memory(None)
    assert shm.decide([("h", "boot", True, True), ("h", "boot", True, True)])
    assert not shm.decide([("h", "boot", True, True), ("other", "boot", True, True)])      # two machines
    assert not shm.decide([("h", "boot", False, True), ("h", "boot", False, True)])         # weak ordering
    assert not shm.decide([("h", None, True, True)])                                         # unknown boot
