"""LoRA on a model built under LazyInitContext (issue 43): peft builds its adapters on meta inside the
context and `boost` materialises them with peft's init (A as nn.Linear's default, B zero) beside the base
weights, each rank its shards. At tp=2 the boosted model's parameters, gathered, equal the unsharded
materialisation, which has the eager peft model's structure (its state dict loads strictly into
`get_peft_model` of an eagerly built model) and starts equal to its base (B = 0); one training step at tp=2
equals that eager peft model's step on one process. Once the lazy adapters lost their values to meta
(peft moves them to its base layer's device, and nothing initialised them again). Inits that read the
base weights are refused before any collective."""

import copy
import math

import peft
import pytest
import torch
import transformers

from meshboost import Booster
from meshboost.booster.lora import enable_lora
from meshboost.lazy import LazyInitContext, lazy_seed
from meshboost.plugins import HybridParallelPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import booster_step, gathered
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS = "LlamaForCausalLM"


def _lora_config(**kw):
    # colwise (q_proj) and rowwise (o_proj, down_proj) bases: A and B are split on different sides
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "o_proj", "down_proj"], **kw)


def _lazy(config):
    with LazyInitContext(seed=11):
        return getattr(transformers, CLS)(copy.deepcopy(config))


def _body(rank: int, world: int) -> None:
    config = tiny_config("llama")
    batch = tiny_batch(CLS, config, batch=4, seed=5)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    model = booster.enable_lora(_lazy(config), lora_config=_lora_config())
    assert lazy_seed(model) == 11 and all(p.is_meta for p in model.parameters())
    ref = LazyInitContext.materialize(copy.deepcopy(model))
    adapters = {n: p for n, p in ref.named_parameters() if ".lora_" in n}
    assert len(adapters) == 2 * 3 * config.num_hidden_layers
    for name, p in adapters.items():
        if ".lora_B." in name:
            assert torch.count_nonzero(p) == 0, name
        else:                                        # kaiming_uniform(a=sqrt(5)): |A| <= 1/sqrt(fan_in)
            assert 0 < p.abs().max() <= 1 / math.sqrt(p.shape[1]), name
    eager = peft.get_peft_model(build_model(CLS, copy.deepcopy(config)), _lora_config())
    eager.load_state_dict(ref.state_dict(), strict=True)     # the eager peft model's names and shapes
    with torch.no_grad():                                     # B = 0: the adapted model starts as its base
        with eager.disable_adapter():
            base_logits = eager(**batch).logits
        assert torch.equal(eager(**batch).logits, base_logits)
    start = {n: p.detach().clone() for n, p in eager.named_parameters()}
    eager_opt = torch.optim.AdamW([p for p in eager.parameters() if p.requires_grad], lr=1e-2, eps=1e-4)
    eager_loss = eager(**batch).loss
    eager_loss.backward()
    eager_opt.step()

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-4)
    model, opt, *_ = booster.boost(model, opt)
    held = dict(model.unwrap().named_parameters())
    assert held.keys() == start.keys() and not any(p.is_meta for p in held.values())
    for name, p in held.items():
        assert torch.equal(gathered(p), start[name]), f"{name} differs after boost"
    loss = booster_step(booster, model, opt, batch)
    assert_close(loss.detach(), eager_loss.detach(), msg="loss at tp=2")
    stepped = dict(eager.named_parameters())
    for name, p in held.items():
        assert_close(gathered(p), stepped[name].detach(), msg=f"tp=2 step: {name}")
    assert any(not torch.equal(stepped[n], start[n]) for n in adapters), "the adapters did not train"


def test_lora_on_a_lazy_model_at_tp2_equals_eager_peft():
    spawn(_body, 2)


class _AnyPlugin:
    def lora_refusal(self):
        return None


@pytest.mark.parametrize("options", [dict(init_lora_weights="pissa"), dict(use_dora=True)])
def test_inits_that_read_the_base_weights_are_refused_on_a_lazy_model(options):
    with pytest.raises(NotImplementedError, match="LazyInitContext"):
        enable_lora(_AnyPlugin(), _lazy(tiny_config("llama")), None, _lora_config(**options), None, False)
