"""HybridParallelPlugin's ZeRO keywords with model parallelism, on 4 processes: `cpu_offload=True`
(fp32 masters and optimizer states on the CPU, the inner step there) at tp=2 x dp=2 ZeRO-1 and
ZeRO-2 and at pp=2 x dp=2 ZeRO-1 (1F1B) gives bitwise the losses and weights of the resident run,
which equals single-process AdamW on the whole batch (fp32, 1e-5); `communication_dtype` sets the
reduce-scatter dtype (bf16 training reducing in fp32 is not the bf16-reducing run, and is closer to
fp32); both are refused without ZeRO."""

import copy

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.optim import ZeroOptimizer
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import booster_step, gathered, train_reference
from meshboost.testing.models import build_model, tiny_config, token_batches

STEPS = 2
CONFIG = tiny_config("llama", num_hidden_layers=4)


def _run(batches, **kwargs):
    """Train with the plugin; returns (dp-summed losses, {name: local weight copy}, {name: live parameter},
    optimizer)."""
    plugin = HybridParallelPlugin(precision=kwargs.pop("precision", "fp32"), **kwargs)
    model = build_model("LlamaForCausalLM", copy.deepcopy(CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    dp, r = plugin.mesh.dp_size, plugin.mesh.dp_rank
    losses = []
    for b in batches:
        loss = booster_step(booster, model, opt, {k: v.chunk(dp)[r] for k, v in b.items()})
        opt.zero_grad()
        t = torch.zeros(1) if loss is None else loss.detach().float().reshape(1).clone()
        dist.all_reduce(t)       # the last stage's loss, summed over dp (other stages add zero)
        losses.append(t.item())
    params = dict(model.unwrap().named_parameters())
    return losses, {n: p.detach().clone() for n, p in params.items()}, params, opt


def _body(rank, world):
    batches = token_batches(CONFIG, STEPS, batch=8, seed=7)
    model = build_model("LlamaForCausalLM", copy.deepcopy(CONFIG))
    reference = train_reference(model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4), batches).weights
    layouts = [dict(tp_size=2, zero_stage=1), dict(tp_size=2, zero_stage=2),
               dict(tp_size=1, pp_size=2, zero_stage=1, microbatch_size=2)]
    for layout in layouts:
        resident = _run(batches, **layout)
        offloaded = _run(batches, cpu_offload=True, **layout)
        where = f"{layout}"
        assert resident[0] == offloaded[0], f"{where}: losses {resident[0]} vs offloaded {offloaded[0]}"
        for name, w in resident[1].items():
            assert torch.equal(w, offloaded[1][name]), f"{where}: {name} differs when offloaded"
        opt = offloaded[3]
        assert isinstance(opt, ZeroOptimizer) and opt.cpu_offload and not resident[3].cpu_offload
        assert all(m.device.type == "cpu" and m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
        assert all(v.device.type == "cpu" for s in opt.optim.state.values() for v in s.values() if torch.is_tensor(v))
        for name, p in offloaded[2].items():
            assert_close(gathered(p), reference[name].detach(), msg=f"{where} weight {name} vs single process")

    # communication_dtype: bf16 training whose gradients are reduce-scattered in fp32
    small = token_batches(CONFIG, 2, batch=4, seq=4, seed=7)
    bf16 = _run(small, tp_size=2, zero_stage=1, precision="bf16")
    bf16_fp32_reduce = _run(small, tp_size=2, zero_stage=1, precision="bf16", communication_dtype=torch.float32)
    assert bf16_fp32_reduce[3].communication_dtype == torch.float32 and bf16[3].communication_dtype == torch.bfloat16
    fp32 = _run(small, tp_size=2, zero_stage=1)
    d_bf16 = max((bf16[1][n].float() - fp32[1][n]).abs().max().item() for n in fp32[1])
    d_mixed = max((bf16_fp32_reduce[1][n].float() - fp32[1][n]).abs().max().item() for n in fp32[1])
    assert d_mixed <= d_bf16, f"reducing in fp32 moved further from fp32 training: {d_mixed} vs {d_bf16}"

    for kwargs, message in ((dict(cpu_offload=True), "cpu_offload=True moves ZeRO's"),
                            (dict(communication_dtype=torch.float16), "communication_dtype=torch.float16 sets")):
        with pytest.raises(ValueError, match=message):
            HybridParallelPlugin(tp_size=2, zero_stage=0, **kwargs)


def test_hybrid_cpu_offload_and_communication_dtype():
    spawn(_body, 4)
