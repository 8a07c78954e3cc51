"""MixedPrecisionOptimizer in one process (no process group; a stand-in mesh of one rank): fp16
working weights with fp32 masters track fp32 training, clipping equals torch's clip_grad_norm_,
an overflow skips the step bitwise, and the memory theory has the ZeRO paper's numbers."""

import copy
import types

import torch

from meshboost.optim import MixedPrecisionOptimizer, PrecisionConfig
from meshboost.optim.memory import memory_breakdown, memory_theory

ONE_RANK = types.SimpleNamespace(tp_rank=0, dp_rank=0, world_group=None, device=torch.device("cpu"),
                                 reduction_rank=lambda param: 0)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def test_fp16_masters_track_fp32_with_clipping():
    g = torch.Generator().manual_seed(3)          # fixed data: the test must not depend on test order
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    ref = _mlp()
    # eps=1e-4: Adam turns a near-zero gradient into a +-lr step whose sign fp16 round-off decides;
    # the comparison is about masters tracking fp32, not about that sign.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    half = copy.deepcopy(ref)
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(half.parameters(), lr=1e-2, eps=1e-4), ONE_RANK,
                                  PrecisionConfig("fp16", max_norm=0.1))
    half.half()
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(ref(x), y)
        loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1).item()
        ref_opt.step(), ref_opt.zero_grad()
        opt.backward(torch.nn.functional.mse_loss(half(x.half()).float(), y))
        opt.step(), opt.zero_grad()
        assert abs(opt.get_grad_norm() - ref_norm) <= 5e-3 * ref_norm
    for p, r in zip(half.parameters(), ref.parameters()):
        assert p.dtype == torch.float16
        torch.testing.assert_close(p.float(), r.detach(), rtol=5e-3, atol=5e-3)
    masters = [m for g in opt.param_groups for m in g["params"]]
    assert all(m.dtype == torch.float32 for m in masters)


def test_overflow_skips_bitwise_and_backs_off():
    model = _mlp()
    opt = MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), ONE_RANK, PrecisionConfig("fp16"))
    model.half()
    opt.scaler.config.hysteresis = opt.scaler.hysteresis_tracker = 1
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(torch.randn(2, 16).half()).sum() * float("inf"))
    opt.step()
    assert opt.get_grad_norm() is None and opt.get_loss_scale() == 2**15
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()), "a skipped step zeroes the grads"


def test_memory_theory_and_breakdown():
    t = memory_theory(1000, tp_size=2, dp_size=4, zero_stage=1, precision="fp16")
    assert t == {"working_weights": 1000.0, "gradients": 1000.0, "fp32_masters": 500.0, "optimizer_states": 1000.0,
                 "total": 3500.0}
    assert memory_theory(1000, 2, 4, 2, "fp16")["gradients"] == 250.0
    assert memory_theory(1000, 1, 1, 0, "fp32")["fp32_masters"] == 0.0
    model = _mlp()
    psi = sum(p.numel() for p in model.parameters())
    opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters()), ONE_RANK, PrecisionConfig("bf16"))
    model.bfloat16()
    for _ in range(2):
        opt.zero_grad()
        opt.backward(model(torch.randn(2, 16).bfloat16()).float().sum())
        if not len(opt.unwrap().state):
            opt.step()
    got = memory_breakdown(model, opt)
    want = memory_theory(psi, precision="bf16")
    for key in ("working_weights", "gradients", "fp32_masters"):
        assert got[key] == want[key], key
    assert abs(got["optimizer_states"] - want["optimizer_states"]) <= 4 * len(list(model.parameters()))  # Adam steps
