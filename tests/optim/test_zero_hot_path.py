"""The step's hot path at dp=2 (two processes, gloo), each run against single-process torch AdamW on the
combined batch (losses and weights within 1e-5 in fp32):

1. the global grad norm is computed only when clipping or tracking (track_grad_norm): an fp32 step
   without clipping issues no all-reduce (ZeRO: one all-gather per bucket and nothing else; plain
   mixed precision: nothing at all), fp16 only the overflow flag's; the weights are bitwise those of a
   run that tracks the norm, whose norm equals torch's; get_grad_norm() is None (with a warning) when
   the norm was not computed.
2. ZeRO in fp32 keeps no master copy: each bucket's weights are views of one flat buffer whose owned
   slice is the master the inner optimizer steps (memory_breakdown counts 0 master bytes, the storage
   is the weights'), with a tied embedding/LM head, through a meta-device build loaded afterwards, and
   through a state_dict round trip; the weights are bitwise those of the offloaded run (separate
   host masters, the layout before this change).
3. overlap_communication is the default: buckets are filled in gradient-ready order (the reverse of
   the parameter order), each reduce-scatter starts from the gradient hook of its last gradient while
   backward still runs, and training is bitwise that of the reduction at step.
4. (ZeRO-2 with pipeline parallelism: tests/pipeline/test_pipeline.py `_check_zero2`.)
5. bf16 gradient accumulation over two backward passes sums the reduced partitions in fp32: exactly
   the fp32 sum of the two single-pass bf16 partitions, which a bf16 sum would not be.
6. the new tensors ZeRO's reduction, cast and write-back allocate per step are the bytes the planner's
   cost model charges (`meshboost.plan.cost.zero_fresh_bytes`), fp32 and bf16.
"""

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from meshboost.distributed import ParallelMesh
from meshboost.distributed.param_info import replace_keeping_object
from meshboost.distributed.profiling import comm_counter
from meshboost.optim import MixedPrecisionOptimizer, PrecisionConfig, ZeroConfig, ZeroOptimizer
from meshboost.optim.memory import memory_breakdown
from meshboost.testing import spawn
from meshboost.testing.compare import train_reference

BUCKET = 100            # elements: the MLP's buckets are [Linear(24, 4)], [bias of Linear(16, 24)], [its weight]
STEPS = 3
ATOL = 1e-5


class Tied(nn.Module):
    """Embedding and LM head share one weight (as GPT-2 and tied Llama do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(20, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 20, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.emb(x))))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 4))


def _data(tied: bool, steps: int = STEPS):
    g = torch.Generator().manual_seed(3)
    if tied:
        return [(torch.randint(0, 20, (8, 6), generator=g), torch.randint(0, 20, (8, 6), generator=g))
                for _ in range(steps)]
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def _loss(model, x, y, dtype=torch.float32):
    if x.dtype == torch.long:
        return nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
    return nn.functional.mse_loss(model(x.to(dtype)).float(), y)


def _reference(make, data):
    """One process on the whole batches: (the model after the steps, each step's global gradient norm)."""
    model = make()
    ref = train_reference(model, torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4), data,
                          loss=lambda model, batch: _loss(model, *batch))
    return model, ref.norms


def _mine(t, mesh):
    return t.chunk(mesh.dp_size)[mesh.dp_rank]


def _boost(make, mesh, zero=True, precision="fp32", max_norm=0.0, track_grad_norm=False, **zero_settings):
    model = make()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    pc = PrecisionConfig(precision, max_norm)
    if zero:
        opt = ZeroOptimizer(inner, mesh, pc, ZeroConfig(**{"stage": 1, "reduce_bucket_size": BUCKET, **zero_settings}),
                            track_grad_norm=track_grad_norm)
    else:
        opt = MixedPrecisionOptimizer(inner, mesh, pc, track_grad_norm=track_grad_norm)
    return model.to({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[precision]), opt


def _train(model, opt, data, mesh, zero=True, dtype=torch.float32):
    """Train on this rank's half of each batch; per step: the collectives of step() and the norm."""
    steps = []
    for x, y in data:
        loss = _loss(model, _mine(x, mesh), _mine(y, mesh), dtype)
        opt.backward(loss)
        if not zero:                      # no ZeRO: average over dp by hand (the DDP's job in a plugin)
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= mesh.dp_size
        with comm_counter() as counter:
            opt.step()
        opt.zero_grad()
        by_op = {}
        for stats in counter.summary().values():
            for op, n in stats["by_op"].items():
                by_op[op] = by_op.get(op, 0) + n
        steps.append((by_op, opt._grad_norm))
    return steps


def _assert_weights(model, ref, what, exact=False):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if exact:
            assert torch.equal(p, q), f"{what}: {name} differs"
        else:
            torch.testing.assert_close(p.detach().float(), q.detach(), rtol=0, atol=ATOL, msg=f"{what}: {name}")


def _check_norm_only_when_asked(mesh):
    data = _data(False)
    ref, ref_norms = _reference(_mlp, data)
    for zero, stage in ((True, 1), (True, 2), (False, None)):
        what = f"zero={zero} stage={stage}"
        kwargs = dict(stage=stage) if zero else {}
        model, opt = _boost(_mlp, mesh, zero, **kwargs)
        steps = _train(model, opt, data, mesh, zero)
        for by_op, norm in steps:
            assert "all_reduce" not in by_op and norm is None, f"{what}: {by_op}"
            assert by_op == ({"all_gather": len(opt.buckets)} if zero else {}), f"{what}: {by_op}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert opt.get_grad_norm() is None and opt.get_grad_norm() is None
        assert len(caught) == 1 and "track_grad_norm" in str(caught[0].message), what
        _assert_weights(model, ref, what)
        tracked, topt = _boost(_mlp, mesh, zero, track_grad_norm=True, **kwargs)
        for (by_op, norm), ref_norm in zip(_train(tracked, topt, data, mesh, zero), ref_norms):
            assert by_op.get("all_reduce") == 1 and abs(norm - ref_norm) <= ATOL * max(1.0, ref_norm), what
        _assert_weights(tracked, model, f"{what}: tracking the norm changed the update", exact=True)
    # fp16: the overflow flag's all-reduce only; clipping adds the norm's
    for max_norm, calls in ((0.0, 1), (0.05, 2)):
        model, opt = _boost(_mlp, mesh, precision="fp16", stage=1, max_norm=max_norm)
        for by_op, _ in _train(model, opt, data[:2], mesh, dtype=torch.float16):
            assert by_op.get("all_reduce") == calls, (max_norm, by_op)


def _check_masters_are_weights(mesh):
    for make in (_mlp, Tied):
        tied = make is Tied
        data = _data(tied)
        ref, _ = _reference(make, data)
        model, opt = _boost(make, mesh, stage=1)
        storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        assert all(b.views_bound() for b in opt.buckets), make.__name__
        assert all(b.master.untyped_storage().data_ptr() in storages for b in opt.buckets), make.__name__
        assert memory_breakdown(model, opt)["fp32_masters"] == 0, make.__name__
        _train(model, opt, data, mesh)
        assert memory_breakdown(model, opt)["fp32_masters"] == 0, make.__name__
        if tied:
            assert model.head.weight is model.emb.weight
        _assert_weights(model, ref, f"{make.__name__} masters = weights")
        # the offloaded run keeps separate (host) masters: the layout before this change, bit for bit
        host, hopt = _boost(make, mesh, stage=1, cpu_offload=True)
        assert not any(b.views_bound() for b in hopt.buckets)
        _train(host, hopt, data, mesh)
        _assert_weights(model, host, f"{make.__name__} vs separate masters", exact=True)

        # state_dict round trip into a fresh optimizer over the same weights: the next step agrees
        again, aopt = _boost(make, mesh, stage=1)
        with torch.no_grad():
            for p, q in zip(again.parameters(), model.parameters()):
                p.copy_(q)
        aopt.load_state_dict(opt.state_dict())
        extra = _data(tied, STEPS + 1)[-1:]
        _train(model, opt, extra, mesh), _train(again, aopt, extra, mesh)
        _assert_weights(again, model, f"{make.__name__} after a state_dict round trip", exact=True)

    # built on meta, materialised and loaded afterwards (new storage): the views are laid out again
    with torch.device("meta"):
        meta = _mlp()
    opt = ZeroOptimizer(torch.optim.AdamW(meta.parameters(), lr=1e-2, eps=1e-4), mesh, PrecisionConfig(),
                        ZeroConfig(stage=2, reduce_bucket_size=BUCKET))
    for p, value in zip(meta.parameters(), _mlp().parameters()):
        replace_keeping_object(p, value.detach().clone())       # as load_model materialises a meta model
    opt.sync_masters_from_model()
    assert all(b.views_bound() for b in opt.buckets)
    data = _data(False)
    _train(meta, opt, data, mesh)
    _assert_weights(meta, _reference(_mlp, data)[0], "boosted on meta")


def _check_overlap_in_gradient_order(mesh):
    data = _data(False)
    ref, _ = _reference(_mlp, data)
    runs = {}
    for stage in (1, 2):
        for overlap in (True, False):
            kwargs = dict(stage=stage) if overlap else dict(stage=stage, overlap_communication=False)
            model, opt = _boost(_mlp, mesh, **kwargs)
            assert opt.overlap_communication == overlap
            first = model[0]
            # buckets in gradient-ready order: the last layer's parameters come first
            assert [b.params for b in opt.buckets] == [[model[2].bias, model[2].weight], [first.bias], [first.weight]]
            issued = []
            reduce = opt._reduce_bucket

            def spy(b, wait=True, reduce=reduce, opt=opt, first=first):
                issued.append((opt.buckets.index(b), first.weight.grad is None and first.bias.grad is None, wait))
                reduce(b, wait)
            opt._reduce_bucket = spy
            x, y = data[0]
            with comm_counter() as counter:
                opt.backward(_loss(model, _mine(x, mesh), _mine(y, mesh)))
            calls = sum(s["by_op"].get("reduce_scatter", 0) for s in counter.summary().values())
            if overlap:
                # bucket 0 starts while the first layer's gradients are not computed yet, asynchronously
                assert [i[0] for i in issued] == [0, 1, 2] and issued[0][1:] == (True, False), issued
                assert all(not wait for _, _, wait in issued) and calls == 3
            else:
                # stage 2 reduces every bucket after backward, stage 1 at step
                assert [i[:2] for i in issued] == ([(0, False), (1, False), (2, False)] if stage == 2 else [])
                assert calls == (3 if stage == 2 else 0), (issued, calls)
            opt.step(), opt.zero_grad()
            del opt._reduce_bucket
            _train(model, opt, data[1:], mesh)
            _assert_weights(model, ref, f"stage {stage} overlap={overlap}")
            runs[stage, overlap] = model
        _assert_weights(runs[stage, True], runs[stage, False], f"stage {stage} overlap vs not", exact=True)


def _check_fp32_accumulation(mesh):
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(8, 16, generator=g) for _ in range(2)]
    ys = [torch.randn(8, 4, generator=g) for _ in range(2)]
    for stage in (1, 2):
        singles = []
        for i in range(2):
            model, opt = _boost(_mlp, mesh, precision="bf16", stage=stage)
            opt.backward(_loss(model, _mine(xs[i], mesh), _mine(ys[i], mesh), torch.bfloat16))
            opt._flush()
            singles.append([b.grad_shard.clone() for b in opt.buckets])
            assert all(s.dtype == torch.bfloat16 for s in singles[-1]), "one pass keeps the working dtype"
            opt.zero_grad()
        model, opt = _boost(_mlp, mesh, precision="bf16", stage=stage)
        for i in range(2):
            opt.backward(_loss(model, _mine(xs[i], mesh), _mine(ys[i], mesh), torch.bfloat16))
        opt._flush()
        rounded = False
        for b, a, c in zip(opt.buckets, *singles):
            assert b.grad_shard.dtype == torch.float32
            assert torch.equal(b.grad_shard, a.float() + c.float()), f"stage {stage}: not the fp32 sum"
            rounded |= not torch.equal((a + c).float(), b.grad_shard)
        assert rounded, f"stage {stage}: a bf16 sum would have given the same numbers; pick other data"
        opt.step()          # the fp32 partition feeds the fp32 masters


class _NewBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the tensors the ops inside it allocate (outputs whose storage no input holds)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held \
                    and not func._schema.is_mutable:
                self.bytes += t.untyped_storage().nbytes()
                held.add(t.untyped_storage().data_ptr())
        return out


def _check_new_buffers_are_the_planners(mesh):
    """What ZeRO's reduction, cast and write-back allocate in one step is what the planner's cost
    model charges at `fresh_bytes_s` (cost.zero_fresh_bytes): fp32 (weights gathered in place) and bf16
    with fp32 masters (the gradient shard cast, the working shard, the gathered bucket)."""
    from meshboost.plan.cost import zero_fresh_bytes
    from meshboost.plan.layout import Layout
    x, y = _data(False)[0]
    for precision in ("fp32", "bf16"):
        model, opt = _boost(_mlp, mesh, precision=precision)
        counter = _NewBytes()
        for name in ("_reduce_bucket", "_finish", "_unscale_and_clip", "_write_back"):
            def counted(*a, method=getattr(opt, name), **k):
                with counter:
                    return method(*a, **k)
            setattr(opt, name, counted)
        opt.backward(_loss(model, _mine(x, mesh), _mine(y, mesh), model[0].weight.dtype))
        opt.step()
        padded = sum(b.shard_size * b.dp_size for b in opt.buckets)
        assert counter.bytes > padded and counter.bytes == zero_fresh_bytes(Layout.of(dp=2, zero=1, precision=precision), padded), \
            (precision, counter.bytes, padded)


def _body(rank, world):
    mesh = ParallelMesh()
    assert mesh.dp_size == 2
    _check_norm_only_when_asked(mesh)
    _check_masters_are_weights(mesh)
    _check_overlap_in_gradient_order(mesh)
    _check_fp32_accumulation(mesh)
    _check_new_buffers_are_the_planners(mesh)


def test_zero_hot_path_dp2():
    spawn(_body, 2)
