"""ColossalAI behaviours real scripts reach (issue 37, point 6), on 2 processes, each against the unsharded
model trained in one process from the same weights and data (SGD, so a wrongly clipped or scaled gradient
shows in the weights; Adam's first step would hide it):

- MoeHybridParallelPlugin(pp_size=2, microbatch_size=1, num_microbatches=2), as ColossalAI's Mixtral
  example passes them: a batch of 2 trains exactly; a batch of 4 is refused on every rank, naming both;
- the boosted optimizer's ColossalAI calls at tp=2, ZeRO-1 over dp=2 and pp=2: `clip_grad_by_norm` clips by
  the global norm (weights after the step equal the clipped reference's), `get_grad_norm()` is the
  reference's norm before clipping on every rank, `clip_grad_by_value` clamps as torch does, `parameters()`,
  `scale_loss` / `unscale_grad` refused without a loss scale, and under fp16 a script's own
  `scale_loss(loss).backward()` + `unscale_grad()` steps as `booster.backward` does; TorchDDPPlugin's plain
  wrapper clips at once with torch's routine; `booster.checkpoint_io.save_model(shard=False)`
  at pp=2 writes one file that from_pretrained loads with the stepped weights, and load_model reads it
  at tp=2;
- sequence_parallelism_mode="ring" (over tp=2, no sp_size) trains as split_gather: the reference's loss
  and weights;
- ring_attn at sp=2 on GPT2LMHeadModel (no *ForCausalLM in its name): the reference's loss and weights;
- shardformer.layer.Linear1D_Col / Linear1D_Row: a two-layer MLP sharded by hand with
  from_native_module, and GPT-2 through a custom Policy naming them, match the unsharded model.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers

from meshboost.booster import Booster
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
from meshboost.shardformer import get_policy
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import gathered
from meshboost.testing.models import build_model, tiny_batch, tiny_config

GPT2 = "GPT2LMHeadModel"
LR = 0.5


def _pair(family: str = "gpt2", cls: str = GPT2, **overrides):
    config = tiny_config(family, **overrides)
    return build_model(cls, copy.deepcopy(config)), build_model(cls, copy.deepcopy(config)), config


def _reference_step(ref, batch, max_norm=None, clip_value=None) -> tuple[float, float]:
    """One SGD step of the unsharded model: (loss, grad norm before clipping)."""
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    loss = ref(**batch).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm if max_norm else float("inf")).item()
    if clip_value is not None:
        torch.nn.utils.clip_grad_value_(ref.parameters(), clip_value)
    opt.step()
    return loss.item(), norm


def _train_step(booster, model, optimizer, batch, before_step=None):
    """One step through the booster (the pipeline schedule with pp); the loss on the ranks that have it."""
    if getattr(booster.plugin, "pp_size", 1) > 1:
        loss = booster.execute_pipeline(iter([batch]), model, lambda out, _: out.loss, optimizer)["loss"]
    else:
        loss = model(**batch).loss
        booster.backward(loss, optimizer)
    if before_step is not None:
        before_step(optimizer)
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _check_weights(model, ref, where: str) -> None:
    """Every parameter this rank holds (its stage's), gathered over tp, equals the reference's."""
    ref_params = ref.state_dict()                # tied names too: a last stage holds lm_head.weight's replica
    held = dict(model.unwrap().named_parameters())
    assert held, where
    for name, p in held.items():
        assert_close(gathered(p), ref_params[name].detach(), msg=f"{where}: weight after the step {name}")


def _microbatches(rank, world):
    par, ref, config = _pair("llama", "LlamaForCausalLM")
    batch = tiny_batch("LlamaForCausalLM", config, batch=2)
    ref_loss, _ = _reference_step(ref, batch)
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=2, ep_size=1, microbatch_size=1, num_microbatches=2)
    booster = Booster(plugin=plugin)
    model, optimizer, *_ = booster.boost(par, torch.optim.SGD(par.parameters(), lr=LR))
    loss = _train_step(booster, model, optimizer, batch)
    if rank == world - 1:
        assert abs(loss.item() - ref_loss) < 1e-5
    _check_weights(model, ref, "pp=2 microbatch_size=1 num_microbatches=2")
    with pytest.raises(ValueError, match="a batch of 4 samples is not num_microbatches=2 x microbatch_size=1 = 2"):
        _train_step(booster, model, optimizer, tiny_batch("LlamaForCausalLM", config, batch=4))


LAYOUTS = {"tp2": dict(tp_size=2), "zero1_dp2": dict(tp_size=1, zero_stage=1),
           "pp2": dict(tp_size=1, pp_size=2, num_microbatches=2)}


def _optimizer_calls(rank, world, tmp):
    for name, layout in LAYOUTS.items():
        par, ref, config = _pair(num_hidden_layers=2)
        batch = tiny_batch(GPT2, config, batch=4)
        ref_loss, ref_norm = _reference_step(ref, batch, max_norm=0.05)
        assert ref_norm > 0.05 * 2                           # the clip matters
        plugin = HybridParallelPlugin(**layout)
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(par, torch.optim.SGD(par.parameters(), lr=LR))
        # ZeRO over dp: each replica trains on its half of the batch, the reference on all of it
        local = {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()} if plugin.dp_size == 2 else batch
        assert optimizer.parameters() and all(isinstance(p, torch.Tensor) for p in optimizer.parameters())
        with pytest.raises(NotImplementedError, match="precision='fp32' has no loss scale"):
            optimizer.scale_loss(torch.ones(()))
        with pytest.raises(NotImplementedError, match="has no loss scale"):
            optimizer.unscale_grad()
        _train_step(booster, model, optimizer, local, before_step=lambda opt: opt.clip_grad_by_norm(0.05))
        norms = [None] * world
        dist.all_gather_object(norms, optimizer.get_grad_norm())
        assert norms[0] == norms[1] and abs(norms[0] - ref_norm) <= 1e-5 * ref_norm, (name, norms, ref_norm)
        _check_weights(model, ref, f"{name} clip_grad_by_norm")
        if name == "pp2":                                  # one consolidated file, as ColossalAI writes it
            _consolidated_save(booster, model, ref, tmp)
        if name == "tp2":                                  # the request lasts one step: clip by value next
            ref_value = copy.deepcopy(ref)
            _reference_step(ref_value, batch, clip_value=1e-3)
            _train_step(booster, model, optimizer, batch, before_step=lambda opt: opt.clip_grad_by_value(1e-3))
            _check_weights(model, ref_value, "tp2 clip_grad_by_value")


def _plain_and_fp16(rank, world):
    """TorchDDPPlugin's plain wrapper clips at once (torch's clip_grad_norm_, the norm returned); under fp16 a
    script's own scale_loss().backward(), unscale_grad(), clip_grad_by_norm() give booster.backward's step."""
    from meshboost.booster.plugin import TorchDDPPlugin

    par, ref, config = _pair()
    batch = tiny_batch(GPT2, config, batch=4)
    batch["labels"] = batch["input_ids"].clone()           # equal tokens per replica: DDP's mean is the whole's
    _, ref_norm = _reference_step(ref, batch, max_norm=0.05)
    booster = Booster(plugin=TorchDDPPlugin())
    model, optimizer, *_ = booster.boost(par, torch.optim.SGD(par.parameters(), lr=LR))
    local = {k: v[2 * rank:2 * rank + 2] for k, v in batch.items()}
    booster.backward(model(**local).loss, optimizer)
    norm = optimizer.clip_grad_by_norm(0.05)
    assert abs(norm.item() - ref_norm) <= 1e-5 * ref_norm and optimizer.get_grad_norm() == norm.item()
    optimizer.step()
    for name, p in model.unwrap().named_parameters():
        assert_close(p, ref.state_dict()[name], msg=f"TorchDDPPlugin clip_grad_by_norm {name}")

    runs = []
    for own_backward in (False, True):
        par, _, config = _pair()
        booster = Booster(plugin=HybridParallelPlugin(tp_size=2, precision="fp16", initial_scale=256))
        model, optimizer, *_ = booster.boost(par, torch.optim.SGD(par.parameters(), lr=LR))
        loss = model(**tiny_batch(GPT2, config, batch=2)).loss
        if own_backward:                                   # as a ColossalAI script may write it
            optimizer.scale_loss(loss).backward()
            optimizer.unscale_grad()
        else:
            booster.backward(loss, optimizer)
        optimizer.clip_grad_by_norm(0.05)
        optimizer.step()
        runs.append((optimizer.get_grad_norm(), {n: p.detach().clone() for n, p in model.unwrap().named_parameters()}))
    assert runs[0][0] is not None and runs[0][0] == runs[1][0]
    for name, p in runs[0][1].items():
        torch.testing.assert_close(runs[1][1][name], p, rtol=0, atol=0, msg=f"fp16 scale_loss path {name}")


def _consolidated_save(booster, model, ref, tmp):
    folder = os.path.join(tmp, "consolidated")
    booster.checkpoint_io.save_model(model, folder, shard=False, use_safetensors=True)
    dist.barrier()
    assert sorted(f for f in os.listdir(folder) if not f.startswith(".")) == \
        ["config.json", "generation_config.json", "model.safetensors"]
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    for name, p in ref.named_parameters():
        assert_close(dict(loaded.named_parameters())[name], p.detach(), msg=f"from_pretrained {name}")
    # and back in at another layout (tp=2)
    other, _, _ = _pair(num_hidden_layers=2)
    booster2 = Booster(plugin=HybridParallelPlugin(tp_size=2))
    other, *_ = booster2.boost(other)
    booster2.load_model(other, folder)
    _check_weights(other, ref, "load_model at tp=2 of the pp=2 consolidated file")


def _sequence_modes(rank, world):
    for name, keywords in {
        "ring over tp": dict(tp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring"),
        "ring_attn at sp=2": dict(tp_size=1, sp_size=2, enable_sequence_parallelism=True,
                                  sequence_parallelism_mode="ring_attn"),
    }.items():
        par, ref, config = _pair()
        batch = tiny_batch(GPT2, config, batch=2, seq=8)
        ref_loss, _ = _reference_step(ref, batch)
        plugin = HybridParallelPlugin(**keywords)
        booster = Booster(plugin=plugin)
        model, optimizer, *_ = booster.boost(par, torch.optim.SGD(par.parameters(), lr=LR))
        loss = _train_step(booster, model, optimizer, batch)
        assert abs(loss.item() - ref_loss) < 1e-5, (name, loss.item(), ref_loss)
        _check_weights(model, ref, name)


def _linear1d(rank, world):
    from meshboost.shardformer.layer import Linear1D_Col, Linear1D_Row
    from meshboost.shardformer.layers import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    par = copy.deepcopy(ref)
    par[0] = Linear1D_Col.from_native_module(par[0], [dist.group.WORLD])     # ColossalAI may pass a list
    par[2] = Linear1D_Row.from_native_module(par[2], dist.group.WORLD, parallel_input=True)
    assert isinstance(par[0], ColumnParallelLinear) and isinstance(par[2], RowParallelLinear)
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_par = ref(x_ref), par(x_par)
    assert_close(out_par, out_ref, msg="Linear1D_Col -> Linear1D_Row output")
    out_ref.pow(2).sum().backward()
    out_par.pow(2).sum().backward()
    assert_close(x_par.grad, x_ref.grad, msg="input gradient")
    for (n, p), r in zip(par.named_parameters(), ref.parameters()):
        assert_close(gathered(p, p.grad), r.grad, msg=f"Linear1D grad {n}")
    with pytest.raises(NotImplementedError, match="skip_bias_add=True"):
        Linear1D_Col.from_native_module(nn.Linear(8, 16), dist.group.WORLD, skip_bias_add=True)

    # a custom Policy written with ColossalAI's layer names: GPT-2's own table with them in place of its styles
    par, ref, config = _pair()
    names = {"colwise": "Linear1D_Col", "rowwise": "Linear1D_Row"}
    base = get_policy(par)
    policy = type(base)(**{**base.__dict__, "name": "gpt2-linear1d",
                           "plan": {k: names.get(v, v) for k, v in base.plan.items()}})
    assert "Linear1D_Col" in policy.plan.values() and "Linear1D_Row" in policy.plan.values()
    batch = tiny_batch(GPT2, config)
    ref_loss, _ = _reference_step(ref, batch)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, custom_policy=policy))
    model, optimizer, *_ = booster.boost(par, torch.optim.SGD(par.parameters(), lr=LR))
    assert any(isinstance(m, Linear1D_Col) for m in model.unwrap().modules())
    loss = _train_step(booster, model, optimizer, batch)
    assert abs(loss.item() - ref_loss) < 1e-5
    _check_weights(model, ref, "custom Policy with Linear1D_Col / Linear1D_Row")


def _body(rank, world, tmp):
    _microbatches(rank, world)
    _optimizer_calls(rank, world, tmp)
    _plain_and_fp16(rank, world)
    _sequence_modes(rank, world)
    _linear1d(rank, world)


def test_colossalai_script_behaviours(tmp_path):
    spawn(_body, 2, str(tmp_path))
