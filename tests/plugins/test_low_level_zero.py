"""LowLevelZeroPlugin (ZeRO data parallelism, no model parallelism) against single-process fp32
AdamW on the combined batch at dp=2: stage 1 fp16 and stage 2 fp32 (with clipping) over 10 steps,
no_sync accumulation in stage 1 and its error in stage 2. The optimizer is the same ZeroOptimizer
HybridParallelPlugin uses."""

import copy
import math

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.optim import ZeroOptimizer
from meshboost.plugins import LowLevelZeroPlugin
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.models import build_model, tiny_config

STEPS = 10


def _batches(config, n, batch=8, seq=8):
    g = torch.Generator().manual_seed(5)
    ids = [torch.randint(1, config.vocab_size, (batch, seq), generator=g) for _ in range(n)]
    return [{"input_ids": i, "labels": i.clone()} for i in ids]


def _model_and_optimizer(config):
    model = build_model("LlamaForCausalLM", copy.deepcopy(config))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)


def _reference(config, batches, max_norm):
    model, opt = _model_and_optimizer(config)
    losses, norms = [], []
    for b in batches:
        loss = model(**b).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm or math.inf).item())
        opt.step(), opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, model


def _body(rank, world):
    config = tiny_config("llama")
    batches = _batches(config, STEPS)
    mine = lambda b, parts=1: [{k: v.chunk(world)[rank].chunk(parts)[i] for k, v in b.items()} for i in range(parts)]
    for stage, precision, max_norm in ((1, "fp16", 0.0), (2, "fp32", 0.5)):
        ref_losses, ref_norms, ref = _reference(config, batches, max_norm)
        plugin = LowLevelZeroPlugin(stage=stage, precision=precision, max_norm=max_norm)
        booster = Booster(plugin=plugin)
        model, opt, *_ = booster.boost(*_model_and_optimizer(config))
        assert isinstance(opt, ZeroOptimizer) and opt.stage == stage
        dtype = {"fp16": torch.float16, "fp32": torch.float32}[precision]
        for step, b in enumerate(batches):
            (part,) = mine(b)
            loss = model(**part).loss
            booster.backward(loss, opt)
            opt.step(), opt.zero_grad()
            t = loss.detach().float().clone()
            dist.all_reduce(t)
            assert abs(t.item() / world - ref_losses[step]) <= LOSS_ATOL[dtype], \
                f"stage {stage} {precision} step {step}: {t.item() / world} vs {ref_losses[step]}"
            if precision == "fp32":
                assert abs(opt.get_grad_norm() - ref_norms[step]) <= 1e-5 * max(1.0, ref_norms[step])
        if precision == "fp32":
            ref_params = dict(ref.named_parameters())
            for name, p in model.unwrap().named_parameters():
                assert_close(p.detach(), ref_params[name].detach(), msg=f"stage {stage} {name}", scale=3)

    # no_sync: stage 1 accumulates two micro-steps locally == one combined-batch step
    _, _, ref = _reference(config, batches[:1], 0.0)
    plugin = LowLevelZeroPlugin(stage=1, precision="fp32")
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(*_model_and_optimizer(config))
    first, second = mine(batches[0], parts=2)
    with booster.no_sync(model, opt):
        booster.backward(model(**first).loss / 2, opt)
    booster.backward(model(**second).loss / 2, opt)
    opt.step()
    ref_params = dict(ref.named_parameters())
    for name, p in model.unwrap().named_parameters():
        assert_close(p.detach(), ref_params[name].detach(), msg=f"no_sync {name}", scale=3)

    plugin = LowLevelZeroPlugin(stage=2, precision="fp32")
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(*_model_and_optimizer(config))
    with pytest.raises(RuntimeError, match="ZeRO stage 2"):
        booster.no_sync(model, opt)
    with pytest.raises(ValueError, match="stage=3"):
        LowLevelZeroPlugin(stage=3)
    with pytest.raises(ValueError, match="precision='fp8'"):
        LowLevelZeroPlugin(precision="fp8")


def test_low_level_zero_dp2():
    spawn(_body, 2)
