"""Booster(mixed_precision=...) with TorchDDPPlugin against a single-process torch.autocast +
GradScaler reference on the combined batch: per-step losses and weights after 3 steps (fp16 and
bf16), the overflow skip, and the configuration errors."""

import copy

import pytest
import torch

from meshboost import Booster
from meshboost.booster.mixed_precision import AMPOptimizer, AutocastModel
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.plugins import TorchDDPPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS, STEPS = "BertForSequenceClassification", 3


def _reference(config, batches, dtype):
    model = build_model(CLS, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    losses = []
    for b in batches:
        with torch.autocast("cpu", dtype=dtype):
            loss = model(**b).loss
        scaler.scale(loss).backward()
        scaler.step(opt), scaler.update(), opt.zero_grad()
        losses.append(loss.item())
    return losses, model


def _body(rank, world):
    config = tiny_config("bert", num_labels=2)
    batches = [tiny_batch(CLS, config, batch=4, seq=8, seed=s) for s in range(STEPS)]
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        ref_losses, ref = _reference(config, batches, dtype)
        model = build_model(CLS, copy.deepcopy(config))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        booster = Booster(plugin=TorchDDPPlugin(), mixed_precision=name)
        model, opt, *_ = booster.boost(model, opt)
        assert isinstance(model, AutocastModel) and isinstance(opt, AMPOptimizer)
        for step, b in enumerate(batches):
            mine = {k: v[rank * 2:(rank + 1) * 2] for k, v in b.items()}      # each rank half of the batch
            loss = model(**mine).loss
            booster.backward(loss, opt)
            opt.step(), opt.zero_grad()
            both = loss.detach().clone()
            torch.distributed.all_reduce(both)
            assert abs(both.item() / world - ref_losses[step]) <= 5e-3, f"{name} step {step}"
        assert opt.skipped_steps == 0
        with booster.no_sync(model):          # the autocast wrapper is peeled for the plugin
            pass
        ref_params = dict(ref.named_parameters())
        for n, p in model.unwrap().named_parameters():
            assert p.dtype == torch.float32, f"{name}: weights must stay fp32 ({n})"
            assert_close(p.detach(), ref_params[n].detach(), dtype=dtype, msg=f"{name} weight {n}")

    # An overflowing scale skips the step on every rank and backs off.
    model = build_model(CLS, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(plugin=TorchDDPPlugin(), mixed_precision="fp16")
    model, opt, *_ = booster.boost(model, opt)
    opt = AMPOptimizer(opt.inner, torch.float16, "cpu", init_scale=2.0**100)
    before = {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}
    booster.backward(model(**batches[0]).loss, opt)
    opt.step()
    assert opt.skipped_steps == 1 and opt.scaler.get_scale() < 2.0**100
    assert all(torch.equal(p, before[n]) for n, p in model.unwrap().named_parameters())

    with pytest.raises(ValueError, match="own precision"):
        Booster(plugin=HybridParallelPlugin(tp_size=2), mixed_precision="fp16")
    with pytest.raises(ValueError, match="mixed_precision='fp8'"):
        Booster(plugin=TorchDDPPlugin(), mixed_precision="fp8")


def test_mixed_precision_ddp():
    spawn(_body, 2)
