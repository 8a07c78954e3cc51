"""Mixture-of-experts under tensor parallelism (issue 25, item 1): transformers' packed experts split
on every expert's intermediate dimension, the router replicated, at tp=2 through the Booster against
single-process training from the same weights and batches: per-step losses (router load-balancing
loss included) within 2e-5 relative, every gathered gradient after the first step, every weight after
the AdamW steps, the saved HF folder reloaded by `from_pretrained`; each rank holds half of every
expert tensor (the experts are split, not replicated); a token routed outside the experts is refused
on every rank (sequence parallelism with experts: test_moe_sequence_parallel.py); the saved folder
loads into a fresh tp=2 model
(`booster.load_model`), and one with another expert count is refused. One process group, the families
looped inside."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers

from meshboost import Booster
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.plugins import HybridParallelPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.moe import MOE_FAMILIES, build_causal_lm, causal_batches, moe_config

# eps=1e-4: Adam turns a near-zero gradient (an embedding row no token used) into a +-lr step whose sign
# round-off decides; the comparison is about the sharding, not that sign (as the other plugin tests)
STEPS, LR, EPS = 3, 1e-3, 1e-4
# router load-balancing loss on where the family has one
ROUTED = {"qwen3_moe": dict(output_router_logits=True), "mixtral": dict(output_router_logits=True)}


def _check_family(name, rank):
    config = moe_config(name, **ROUTED.get(name, {}))
    batches = causal_batches(config, STEPS)
    ref = build_causal_lm(config)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    model = build_causal_lm(config)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    model, opt, *_ = booster.boost(model, opt)
    inner = model.unwrap()
    experts = [(n, p) for n, p in inner.named_parameters() if ".experts." in n and p.dim() == 3]
    assert experts, name
    for n, p in experts:              # split, not replicated: half of every expert tensor on each rank
        info = get_tp_info(p)
        assert info is not None and p.numel() * 2 == torch.Size(info.full_shape).numel(), f"{name}: {n} is whole"
    ref_params = dict(ref.named_parameters())
    for step, batch in enumerate(batches):
        ref_loss = ref(**batch).loss
        ref_loss.backward()
        loss = model(**batch).loss
        booster.backward(loss, opt)
        assert abs(loss.item() - ref_loss.item()) <= 2e-5 * abs(ref_loss.item()), \
            f"{name} step {step}: loss {loss.item()} vs {ref_loss.item()}"
        if step == 0:
            for n, p in inner.named_parameters():
                assert_close(gather_tensor(p.grad, get_tp_info(p)), ref_params[n].grad, msg=f"{name} grad {n}")
        ref_opt.step(), ref_opt.zero_grad()
        opt.step(), opt.zero_grad()
    for n, p in inner.named_parameters():
        assert_close(gather_tensor(p.detach(), get_tp_info(p)), ref_params[n].detach(), msg=f"{name} weight {n}")
    folder = os.path.join(tempfile.gettempdir(), f"meshboost_moe_tp_{name}_{os.environ.get('MASTER_PORT', '0')}")
    booster.save_model(model, folder, shard=True)
    dist.barrier()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    for n, p in reloaded.named_parameters():
        assert torch.equal(p.detach(), ref_params[n].detach().to(p.dtype)) or \
            torch.allclose(p.detach(), ref_params[n].detach(), atol=1e-6), f"{name}: saved {n} differs"
    return folder


def _load_into_tp(folder, rank):
    """booster.load_model reads the HF folder into a fresh tp=2 model, each rank its slices of every
    expert; a model with another expert count is refused on every rank, naming the tensor."""
    config = moe_config("qwen3_moe")
    saved = transformers.AutoModelForCausalLM.from_pretrained(folder)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    model, *_ = booster.boost(build_causal_lm(config, seed=1))
    booster.load_model(model, folder)
    for n, p in model.unwrap().named_parameters():
        assert torch.equal(gather_tensor(p.detach(), get_tp_info(p)), dict(saved.named_parameters())[n].detach()), n
    other, *_ = booster.boost(build_causal_lm(moe_config("qwen3_moe", num_experts=8)))
    with pytest.raises(ValueError, match=r"experts\.gate_up_proj.*shape \(4, 64, 64\).*\(8, 64, 64\)"):
        booster.load_model(other, folder)


def _route_out_of_range(module, args, output):
    logits, weights, ids = output
    ids = ids.clone()
    ids[0, 0] = module.num_experts                 # one token to expert E (there are E: 0 .. E-1)
    return logits, weights, ids


def _body(rank, world):
    folders = {name: _check_family(name, rank) for name in MOE_FAMILIES}
    _load_into_tp(folders["qwen3_moe"], rank)
    # a token routed outside the experts is an error on every rank, not a silently dropped route
    model = build_causal_lm(moe_config("qwen3_moe"))
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(model)
    model.unwrap().model.layers[0].mlp.gate.register_forward_hook(_route_out_of_range)
    with pytest.raises(ValueError, match="routed to expert id 4, outside the 4 experts"):
        model(input_ids=torch.ones(2, 4, dtype=torch.long))


def test_moe_experts_under_tensor_parallelism():
    spawn(_body, 2)
