"""Issue 58's objectives under ZeRO-3 (FSDP2) and with LoRA, on 2 processes (fp32, tiny Llama), through
`preference_step`, each against one process from the same weights and pairs over two SGD steps (the global loss
per step within 2e-5 relative, every logged reward, margin, accuracy and log-prob equal, the second step moved):

- dp=2 with zero_stage=3: DPO (label smoothing 0.1), IPO, SimPO, ORPO; the reference boosted by the same booster
  (FSDP2 over a frozen model: no optimizer, eval);
- LoRA (peft, random lora_B so the policy differs from its base from step one) with the reference the policy's
  own base weights (`reference=BASE`: peft's disable_adapter(), no second copy): DPO and IPO at dp=2 with ZeRO-1,
  DPO at tp=2 and at pp=2 (the base scored through execute_pipeline under disable_adapter()); the one process
  scores its reference on the base model itself (no adapters), so a disable_adapter() that did nothing shows;
- `reference=BASE` on a model without adapters is refused (TypeError naming peft).
One process group, the layouts looped inside."""

import copy

import pytest
import torch
import transformers as tfm

from meshboost import Booster
from meshboost.pipeline.config import PipelineConfig
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, ZeroConfig
from meshboost.post_training import BASE, boost_reference, preference_step
from meshboost.testing import spawn

from tests.post_training.pairs import (LR, REFERENCED, STEPS, compare, one_process, preference_config,
                                       preference_steps, random_pairs, replica)

peft = pytest.importorskip("peft")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _base(config):
    torch.manual_seed(0)
    return tfm.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def _lora(config, booster=None):
    base = _base(config)
    torch.manual_seed(7)                       # the adapters' random init: the same everywhere
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    return booster.enable_lora(base, lora_config=lora) if booster is not None else peft.get_peft_model(base, lora)


def _one_process(objective, config, pairs, lora: bool) -> list[dict]:
    model = _lora(config) if lora else _base(config)
    # LoRA: the base as a model of its own (frozen under LoRA), not through adapters_disabled, which is under test
    ref = _base(config).eval() if lora else copy.deepcopy(model).eval() if objective in REFERENCED else None
    return one_process(objective, model, ref, pairs)


def _boosted(objective, config, pairs, plugin_config, lora: bool) -> list[dict]:
    booster = Booster(plugin=HybridParallelPlugin(plugin_config))
    policy = _lora(config, booster) if lora else _base(config)
    ref = None
    if lora:
        ref = BASE
    elif objective in ("dpo", "ipo"):
        ref = boost_reference(booster, copy.deepcopy(policy))
    params = [p for p in policy.parameters() if p.requires_grad]
    model, optimizer, *_ = booster.boost(policy, torch.optim.SGD(params, lr=LR))
    return preference_steps(booster, model, optimizer, pairs, objective, ref)


CASES = [("dp2 zero3", HybridParallelConfig(zero=ZeroConfig(stage=3)), False, ("dpo", "ipo", "simpo", "orpo")),
         ("lora dp2 zero1", HybridParallelConfig(zero=ZeroConfig(stage=1)), True, ("dpo", "ipo")),
         ("lora tp2", HybridParallelConfig(tp_size=2), True, ("dpo",)),
         ("lora pp2", HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2)), True, ("dpo",))]


def _body(rank, world_size):
    config = preference_config()
    pairs = [random_pairs(20 + s) for s in range(STEPS)]
    wants = {}
    for what, plugin_config, lora, objectives in CASES:
        for objective in objectives:
            if (objective, lora) not in wants:
                wants[(objective, lora)] = _one_process(objective, config, pairs, lora)
            got = _boosted(objective, config, pairs, plugin_config, lora)
            compare(got, wants[(objective, lora)], f"{objective} {what}")
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig()))
    plain = _base(config)
    model, optimizer, *_ = booster.boost(plain, torch.optim.SGD(plain.parameters(), lr=LR))
    with pytest.raises(TypeError, match="peft"):
        preference_step(booster, model, optimizer, replica(pairs[0], rank, 2), "dpo", reference=BASE)


def test_post_training_zero3_lora():
    spawn(_body, 2)
