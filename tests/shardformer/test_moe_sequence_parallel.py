"""Megatron sequence parallelism with tensor-parallel MoE experts (issue 42, point 3), against single-process
AdamW training from the same weights and batches (fp32):

- tp=2 with enable_sequence_parallelism (world 2), Qwen3-MoE and Mixtral with the router's load-balancing
  loss on (coefficient 0.5, so a doubled or halved aux gradient would show), Qwen2-MoE (a replicated shared
  expert and its sigmoid gate, loss on) and DeepSeek-V3 (a tensor-parallel shared expert, MLA): every step's
  loss and aux loss, every gradient gathered from its shards after the first step (each router's weight
  included: summed once over tp, not twice), every weight after the AdamW steps; one batch carries an
  attention mask, which the load-balancing loss applies to the gathered router logits in batch order;
- tp=2 x ep=2 with sequence parallelism (world 4: dp=2, ZeRO-1, clipped by the global norm): each step's
  loss and gradient norm and the weights after the steps equal one process's with each replica's own
  load-balancing loss (DDP's semantics);
- DeepSeek-V3's auxiliary-loss-free bias update at tp=2 with sequence parallelism (loads counted on each rank's
  chunk, summed over tp): the biases after the steps equal one process's;
- what stays refused, on every rank before any change: experts fed one row block per expert (Llama-4).
Two process groups (each layout at its smallest world), the configurations looped inside."""

import pytest
import torch
import transformers

from meshboost import Booster
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, PrecisionConfig, ZeroConfig
from meshboost.testing import assert_close, spawn
from meshboost.testing.moe import COMMON, LR, EPS, build_causal_lm, causal_batches, moe_config, train_boosted, \
    train_whole, train_whole_with_bias

STEPS = 2
RATE = 1e-2                # the router bias update's rate
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)


def _sp(**kwargs) -> HybridParallelConfig:
    return HybridParallelConfig(tp_size=2, sequence_parallel=True, **kwargs)


def _configs():
    qwen2 = transformers.Qwen2MoeConfig(**{**COMMON, **AUX}, moe_intermediate_size=32, num_experts=4,
                                        shared_expert_intermediate_size=32, num_experts_per_tok=2,
                                        decoder_sparse_step=1, mlp_only_layers=[])
    return {"qwen3_moe": moe_config("qwen3_moe", **AUX), "mixtral": moe_config("mixtral", **AUX), "qwen2_moe": qwen2,
            "deepseek_v3": moe_config("deepseek_v3")}


def _batches(config):
    batches = causal_batches(config, STEPS, batch=2, seq=8)
    mask = torch.ones_like(batches[1]["input_ids"])
    mask[0, -3:] = 0                                   # a padded row: the aux loss masks its tokens
    batches[1]["attention_mask"] = mask
    batches[1]["labels"][0, -3:] = -100
    return batches


def _check_tp_sp(name, config):
    batches = _batches(config)
    ref = build_causal_lm(config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    model = build_causal_lm(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    booster = Booster(plugin=HybridParallelPlugin(_sp()))
    model, opt, *_ = booster.boost(model, opt)
    inner = model.unwrap()
    ref_params = dict(ref.named_parameters())
    routers = [n for n in ref_params if ".mlp.gate." in n or "shared_expert_gate" in n]
    assert routers, name
    for step, batch in enumerate(batches):
        ref_out = ref(**batch)
        ref_out.loss.backward()
        out = model(**batch)
        booster.backward(out.loss, opt)
        assert abs(out.loss.item() - ref_out.loss.item()) <= 2e-5 * abs(ref_out.loss.item()), \
            f"{name} step {step}: loss {out.loss.item()} vs {ref_out.loss.item()}"
        if ref_out.aux_loss is not None:
            assert abs(out.aux_loss.item() - ref_out.aux_loss.item()) <= 1e-5 * abs(ref_out.aux_loss.item()), \
                f"{name} step {step}: aux loss {out.aux_loss.item()} vs {ref_out.aux_loss.item()}"
        if step == 0:
            for n, p in inner.named_parameters():
                assert_close(gather_tensor(p.grad, get_tp_info(p)), ref_params[n].grad, msg=f"{name} grad {n}")
            for n in routers:                # a router gradient counted twice would not be caught by Adam's step
                assert ref_params[n].grad.abs().max() > 0, f"{name}: {n} got no gradient"
        ref_opt.step(), ref_opt.zero_grad()
        opt.step(), opt.zero_grad()
    for n, p in inner.named_parameters():
        assert_close(gather_tensor(p.detach(), get_tp_info(p)), ref_params[n].detach(), msg=f"{name} weight {n}")


def _bias_update():
    """DeepSeek-V3's bias update under sequence parallelism: each tp rank routes its own chunk, so the loads are
    summed over tp as well; the biases after the steps equal one process's (which counts the whole batch)."""
    config = moe_config("deepseek_v3")
    batches = causal_batches(config, STEPS, batch=2, seq=8)
    losses, params, biases = train_whole_with_bias(config, batches, RATE)
    assert any(b.abs().sum() > 0 for b in biases.values())       # the update happened
    _, model, _ = train_boosted(config, batches, _sp(moe_router_bias_update_rate=RATE), losses, params, "bias sp")
    got = {n: b for n, b in model.unwrap().named_buffers() if n.endswith("e_score_correction_bias")}
    assert got.keys() == biases.keys()
    for n, b in got.items():
        torch.testing.assert_close(b, biases[n], rtol=0, atol=1e-7, msg=f"bias sp {n}")


def _refused():
    """Llama-4's experts take one row block per expert ([E * tokens, H]), which the token gather cannot
    feed: refused on every rank before anything is modified."""
    model = build_causal_lm(moe_config("llama4_text"))
    plugin = HybridParallelPlugin(_sp())
    with pytest.raises(NotImplementedError, match=r"experts.*sequence parallelism gathers the experts' tokens"):
        Booster(plugin=plugin).boost(model, torch.optim.AdamW(model.parameters()))
    assert all(get_tp_info(p) is None for p in model.parameters()), "refused after changing the model"


def _body_tp(rank, world):
    for name, config in _configs().items():
        _check_tp_sp(name, config)
    _bias_update()
    _refused()


def _body_tp_ep(rank, world):
    config = moe_config("qwen3_moe", **AUX)
    batches = causal_batches(config, STEPS, batch=4, seq=8, seed=7)
    norms = []
    ref_losses, ref_params = train_whole(config, batches, replicas=2, max_norm=0.05, norms=norms)
    assert all(n > 0.05 for n in norms), norms                 # the clip is active
    plugin_config = _sp(ep_size=2, zero=ZeroConfig(stage=1), precision=PrecisionConfig(max_norm=0.05))
    train_boosted(config, batches, plugin_config, ref_losses, ref_params, "tp2 ep2 sp", ref_norms=norms)


def test_moe_sequence_parallel_tp2():
    spawn(_body_tp, 2)


def test_moe_sequence_parallel_tp2_ep2():
    spawn(_body_tp_ep, 4)
