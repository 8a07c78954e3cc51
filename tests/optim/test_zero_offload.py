"""ZeroOptimizer's options in one process (a one-rank gloo group, so dp = 1 and every collective is the
identity): cpu_offload gives bitwise the numbers of the resident run in fp32, fp16 and bf16 at stages
1 and 2 with clipping, copies one gradient shard down and one updated shard up per bucket and step
(none on a skipped fp16 step: the overflow check runs before the CPU step), keeps masters and states
on the CPU even when the working weights live elsewhere (meta), also after loading a state dict;
master_weights=False is torch's AdamW stepping the bf16 weights; communication_dtype rounds the
reduced gradients to that dtype; verbose logs skipped steps."""

import gc
import logging

import pytest
import torch
import torch.distributed as dist

from meshboost.distributed import ParallelMesh
from meshboost.optim import PrecisionConfig, ZeroConfig, ZeroOptimizer

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
BUCKET = 300            # elements: the MLP's 676 parameters make three buckets per kind


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ParallelMesh()
    finally:
        gc.collect()          # groups kept alive by reference cycles go before the default group
        dist.destroy_process_group()


def _mlp(device=None):
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def _data(steps=4):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


def _boost(mesh, precision, model=None, max_norm=0.0, verbose=False, **zero_settings):
    model = model if model is not None else _mlp()
    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4), mesh,
                        PrecisionConfig(precision, max_norm), ZeroConfig(reduce_bucket_size=BUCKET, **zero_settings),
                        verbose=verbose)
    return model.to(DTYPES[precision]), opt


def _train(model, opt, data, precision):
    losses = []
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x.to(DTYPES[precision])).float(), y)
        opt.backward(loss)
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses


def _states(opt):
    return [v for m in opt.param_groups[0]["params"] for v in opt.optim.state[m].values() if v.dim() > 0]


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_offload_is_bitwise_the_resident_run(mesh, stage, precision):
    data = _data()
    resident = _boost(mesh, precision, stage=stage, max_norm=0.5)
    offloaded = _boost(mesh, precision, stage=stage, max_norm=0.5, cpu_offload=True)
    assert _train(*resident, data, precision) == _train(*offloaded, data, precision)
    for a, b in zip(resident[0].parameters(), offloaded[0].parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_states(resident[1]), _states(offloaded[1])):
        assert torch.equal(a, b.to(a.device))
    opt = offloaded[1]
    assert resident[1].staging is None and opt.cpu_offload
    assert all(m.device.type == "cpu" and m.dtype == torch.float32 for m in opt.param_groups[0]["params"])
    assert all(s.device.type == "cpu" for s in _states(opt))
    # one copy per bucket each way per step, of this rank's shard in the working dtype
    shard_bytes = sum(b.shard_size for b in opt.buckets) * DTYPES[precision].itemsize
    assert (opt.staging.copies_to_host, opt.staging.copies_to_device) == (4 * len(opt.buckets),) * 2
    assert (opt.staging.bytes_to_host, opt.staging.bytes_to_device) == (4 * shard_bytes,) * 2


def test_fp16_overflow_is_checked_before_the_cpu_step(mesh, caplog):
    model, opt = _boost(mesh, "fp16", stage=2, cpu_offload=True, verbose=True)
    x, y = _data(1)[0]
    before = [p.detach().clone() for p in model.parameters()]
    scale = opt.loss_scale
    opt.backward(torch.nn.functional.mse_loss(model(x.half()).float(), y) * float("inf"))
    with caplog.at_level(logging.INFO, logger="meshboost.optim"):
        opt.step()
    assert opt.get_grad_norm() is None and opt.staging.copies_to_host == 0 and opt.staging.copies_to_device == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.loss_scale == scale and opt.scaler.hysteresis_tracker == 1      # hysteresis 2: first overflow
    assert "step skipped" in caplog.text
    assert _states(opt) == []                                                  # the CPU step never ran


def test_masters_and_states_stay_on_the_cpu_when_the_weights_do_not(mesh):
    """The working device is meta here (no storage): placement must not follow it."""
    source, opt = _boost(mesh, "fp16", stage=1, cpu_offload=True)
    _train(source, opt, _data(2), "fp16")
    saved = opt.state_dict()

    meta_model, meta_opt = _boost(mesh, "fp16", model=_mlp("meta"), stage=1, cpu_offload=True)
    resident_meta = _boost(mesh, "fp16", model=_mlp("meta"), stage=1)[1]
    assert all(m.is_meta for m in resident_meta.param_groups[0]["params"])      # resident: on the working device
    assert all(m.device.type == "cpu" for m in meta_opt.param_groups[0]["params"])
    meta_opt.load_state_dict(saved)
    assert all(p.is_meta for p in meta_model.parameters())
    assert all(s.device.type == "cpu" for s in _states(meta_opt)) and len(_states(meta_opt)) == len(_states(opt))
    for a, b in zip(opt.param_groups[0]["params"], meta_opt.param_groups[0]["params"]):
        assert torch.equal(a, b)
    for a, b in zip(_states(opt), _states(meta_opt)):
        assert torch.equal(a, b)


def test_master_weights_false_is_adamw_on_the_bf16_weights(mesh):
    data = _data()
    ref = _mlp().bfloat16()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    for x, y in data:
        torch.nn.functional.mse_loss(ref(x.bfloat16()).float(), y).backward()
        ref_opt.step(), ref_opt.zero_grad()
    for offload in (False, True):
        model, opt = _boost(mesh, "bf16", stage=2, master_weights=False, cpu_offload=offload)
        _train(model, opt, data, "bf16")
        assert not opt.keeps_masters and opt.master_weight(next(model.parameters())) is None
        assert all(m.dtype == torch.bfloat16 for m in opt.param_groups[0]["params"])
        assert all(s.dtype == torch.bfloat16 for s in _states(opt))
        for a, b in zip(ref.parameters(), model.parameters()):
            assert torch.equal(a, b)
        entries = opt.state_dict()["state"]
        assert all("master" not in e for e in entries.values())    # the weights are the masters
        again = _boost(mesh, "bf16", stage=2, master_weights=False, cpu_offload=offload)[1]
        again.load_state_dict(opt.state_dict())
        for a, b in zip(_states(opt), _states(again)):
            assert torch.equal(a, b)


def test_communication_dtype_rounds_the_reduced_gradients(mesh):
    data = _data(3)
    ref = _mlp()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    for x, y in data:
        torch.nn.functional.mse_loss(ref(x), y).backward()
        for p in ref.parameters():
            p.grad = p.grad.bfloat16().float()
        ref_opt.step(), ref_opt.zero_grad()
    model, opt = _boost(mesh, "fp32", stage=1, communication_dtype=torch.bfloat16)
    _train(model, opt, data, "fp32")
    for a, b in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_zero_config_checks():
    with pytest.raises(ValueError, match="communication_dtype=torch.int8"):
        ZeroConfig(stage=1, communication_dtype=torch.int8)
    config = ZeroConfig(stage=2, cpu_offload=1, master_weights=0)
    assert config.cpu_offload is True and config.master_weights is False and config.communication_dtype is None
