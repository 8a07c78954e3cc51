"""HybridAdam / CPUAdam / FusedAdam are torch's Adam under ColossalAI's signatures: their steps
equal torch.optim.AdamW (adamw_mode=True) and torch.optim.Adam with an L2 penalty
(adamw_mode=False) bit for bit, with param groups, weight decay and a LR schedule; on the CPU
they run torch's foreach kernel, state on the parameter's device; what torch cannot do is refused
by name. (The fused CUDA path is chosen when every parameter of a group is on CUDA: not run here.)"""

import copy

import pytest
import torch

from meshboost.nn.optimizer import CPUAdam, FusedAdam, HybridAdam

STEPS = 6


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(7, 5, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True),
            torch.randn(3, 4, generator=g, requires_grad=True)]


def _run(make, steps=STEPS):
    params = _params()
    groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
    opt = make(groups)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for step in range(steps):
        opt.zero_grad()
        loss = sum(((p * (step + 1)) ** 2).sum() + p.sum() for p in params)
        loss.backward()
        opt.step()
        sched.step()
    return params, opt


def _same(a, b):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_steps_equal_torch(adamw_mode):
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref, _ = _run(lambda g: torch_cls(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, foreach=True))
    for cls in (HybridAdam, CPUAdam, FusedAdam):
        mine, opt = _run(lambda g: cls(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-6, adamw_mode=adamw_mode))
        _same(mine, ref)
        assert opt.param_groups[0]["foreach"] is True and opt.param_groups[0]["fused"] is False
        state = opt.state[mine[0]]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"} and state["exp_avg"].device == mine[0].device
        assert float(state["step"]) == STEPS
    # torch's default (single-tensor) kernel on the CPU: the same maths, rounding may differ in the last bit
    default, _ = _run(lambda g: torch_cls(g, lr=1e-2, betas=(0.8, 0.99), eps=1e-6))
    for x, y in zip(mine, default):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def test_amsgrad_and_defaults():
    ref, _ = _run(lambda g: torch.optim.AdamW(g, lr=1e-3, amsgrad=True, foreach=True))
    mine, _ = _run(lambda g: HybridAdam(g, lr=1e-3, amsgrad=True))
    _same(mine, ref)
    opt = HybridAdam(_params())
    assert opt.defaults["weight_decay"] == 0 and opt.defaults["eps"] == 1e-8 and opt.adamw_mode


def test_state_dict_round_trip_continues_identically():
    first, opt = _run(lambda g: HybridAdam(g, lr=1e-2, weight_decay=0.01), steps=2)
    params = [p.detach().clone().requires_grad_() for p in first]
    again = HybridAdam([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}],
                       lr=1e-2)
    again.load_state_dict(copy.deepcopy(opt.state_dict()))       # torch's load may alias the saved tensors
    assert float(again.state[params[0]]["step"]) == 2
    for ps, o in ((first, opt), (params, again)):
        for _ in range(2):
            o.zero_grad()
            sum((p ** 3).sum() for p in ps).backward()
            o.step()
    _same(params, first)


def test_fused_adam_zero_grad_follows_set_grad_none():
    for set_grad_none in (True, False):
        p = torch.ones(3, requires_grad=True)
        opt = FusedAdam([p], set_grad_none=set_grad_none)
        p.sum().backward()
        opt.zero_grad()
        assert (p.grad is None) == set_grad_none


@pytest.mark.parametrize("kwargs, match", [
    (dict(bias_correction=False), "bias_correction=False"),
    (dict(nvme_offload_fraction=0.5, nvme_offload_dir="/tmp"), "NVMe"),
    (dict(foreach=True), r"unsupported arguments \['foreach'\]"),
])
def test_unsupported_arguments_are_refused(kwargs, match):
    with pytest.raises((NotImplementedError, TypeError), match=match):
        HybridAdam(_params(), **kwargs)
    HybridAdam(_params(), nvme_offload_fraction=0.0, nvme_offload_dir="/unused")       # ColossalAI ignores the dir
