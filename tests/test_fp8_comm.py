"""fp8-compressed all-reduce (`meshboost.distributed.fp8`, ColossalAI's fp8_communication) on 4 gloo
processes (the e4m3 payload travels as uint8): the result is within the e4m3 error bound of the exact
fp32 sum and mean for several sizes (padding included), a quarter of fp32's payload bytes on the wire,
non-finite inputs stay non-finite (so fp16 loss scalers still skip the step), and torch DDP with the
fp8 hook trains a tiny Llama to within 2% of the loss DDP's fp32 all-reduce reaches (95% of its
progress). The plugins accept
it on CUDA only (the CUDA test in tests/test_cuda.py registers it through TorchDDPPlugin)."""

import copy

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from meshboost.distributed import comm, comm_counter
from meshboost.distributed.fp8 import FP8_MAX, RELATIVE_STEP, all_reduce_fp8, dequantize, fp8_allreduce_hook, quantize
from meshboost.testing import spawn
from meshboost.testing.models import build_model, tiny_config


def _bound(inputs: list[torch.Tensor], total: torch.Tensor) -> float:
    """Rounding to nearest at 3 mantissa bits: each rank's quantisation errs by at most half a step of
    its largest value (2^-4 relative), the re-quantised sum by half a step of the sum's largest chunk
    value (bounded by its global max plus the first error)."""
    first = sum(t.abs().max().item() for t in inputs) * RELATIVE_STEP
    return first + (total.abs().max().item() + first) * RELATIVE_STEP


def _body(rank: int, world: int) -> None:
    group = dist.group.WORLD
    # quantize/dequantize round trip within half a step of the max
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3
    payload, scale = quantize(x)
    assert payload.dtype == torch.uint8 and (dequantize(payload, scale) - x).abs().max() <= x.abs().max() * 2 ** -4
    assert dequantize(*quantize(torch.zeros(5))).abs().max() == 0
    assert torch.isclose(dequantize(*quantize(torch.tensor([FP8_MAX * 10.0])))[0], torch.tensor(FP8_MAX * 10.0))

    for n in (1, 7, 1000, 4099):
        g = torch.Generator().manual_seed(100 + n)
        inputs = [torch.randn(n, generator=g) * (r + 1) for r in range(world)]
        exact = torch.stack(inputs).sum(0)
        for average in (False, True):
            t = inputs[rank].clone()
            with comm_counter() as counted:
                all_reduce_fp8(t, group, average=average)
            want = exact / world if average else exact
            err = (t - want).abs().max().item()
            bound = _bound(inputs, exact) / (world if average else 1)
            assert err <= bound, f"n={n} average={average}: error {err} > bound {bound}"
            out = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(out, t)
            assert all(torch.equal(o, out[0]) for o in out), "ranks disagree on the fp8 all-reduce result"
            stats = counted.summary()["world"]
            chunk = -(-n // world)
            # payloads: all-to-all of chunk*world bytes + all-gather of chunk*world bytes; scales: 2 x world x 4
            assert stats["payload_bytes"] == 2 * chunk * world + 2 * world * 4, (n, stats)
            with comm_counter() as fp32:
                comm.all_reduce(inputs[rank].clone(), group)
            ratio = stats["sent_bytes"] / fp32.summary()["world"]["sent_bytes"]
            assert n < 4000 or ratio < 0.26, f"n={n}: fp8 sends {ratio:.3f} of fp32's bytes"
    # a non-finite value anywhere makes the result non-finite everywhere (fp16 overflow detection)
    t = torch.ones(64)
    if rank == 1:
        t[3] = float("inf")
    all_reduce_fp8(t, group)
    assert not torch.isfinite(t).all()

    # DDP with the fp8 hook against DDP's own fp32 all-reduce, same tiny Llama and data
    config = tiny_config("llama")
    g = torch.Generator().manual_seed(9)
    batches = [torch.randint(1, config.vocab_size, (8, 16), generator=g) for _ in range(6)]
    finals = {}
    for name in ("fp32", "fp8"):
        model = DistributedDataParallel(build_model("LlamaForCausalLM", copy.deepcopy(config)))
        if name == "fp8":
            model.register_comm_hook(group, fp8_allreduce_hook)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for ids in batches * 2:
            mine = ids.chunk(world)[rank]
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
            opt.step(), opt.zero_grad()
        with torch.no_grad():
            finals[name] = sum(model(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
    assert abs(finals["fp8"] - finals["fp32"]) <= 0.02 * finals["fp32"], finals
    initial = build_model("LlamaForCausalLM", copy.deepcopy(config))
    with torch.no_grad():
        start = sum(initial(input_ids=b, labels=b).loss.item() for b in batches) / len(batches)
    # fp8 makes at least 95% of fp32's progress from the initial loss
    assert start - finals["fp8"] >= 0.95 * (start - finals["fp32"]) > 0, (start, finals)


def test_fp8_all_reduce_and_ddp_hook():
    spawn(_body, 4)
