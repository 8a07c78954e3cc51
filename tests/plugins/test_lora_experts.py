"""LoRA on packed MoE experts (peft's `target_parameters`: `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj`), 4 ranks, fp32, each layout against one process training the same peft model on
the whole batches: per-step loss within 2e-5 relative, and every adapter (gathered over tp and ep) and
frozen weight after 2 AdamW steps.

- Qwen3-MoE, Mixtral, DeepSeek-V3 (shared experts, a dense first layer) and GPT-OSS (the [E, in, out]
  layout, interleaved gate/up rows, expert biases) at tp=2 x dp=2 with ZeRO-1, ep=2 x edp=2 with ZeRO-1 and
  tp=2 x ep=2 (DDP for the dense weights, the optimizer averaging the experts'). The adapters are split
  as `shardformer/lora_experts.py` says (checked on their shapes) and are expert weights under ep.
- GLM-4-MoE whose router only picks experts 0 and 1 (ep rank 0's) at ep=2 with ZeRO-2: the starved
  rank's adapters still get (zero) gradients, so its buckets match and nothing hangs.
- At tp=2 x ep=2 each family's `save_lora_as_pretrained` folder holds peft's names and the one-process
  adapters; `PeftModel.from_pretrained` loads it into a fresh base, and its `merge_and_unload()` gives
  the logits of the one-process model merged.
- Bad inputs, refused on every rank at `boost` before any collective: experts whose intermediate size
  tp does not divide, an adapter on the experts' bias, on a parameter of a linear the plan splits, and
  ep leaving one expert of GPT-OSS's transposed layout per rank.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.distributed.param_info import gather_tensor, get_tp_info, grad_reduction
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, ZeroConfig
from meshboost.testing import assert_close, spawn
from meshboost.testing.moe import build_causal_lm, causal_batches, moe_config, train_boosted, train_whole

peft = pytest.importorskip("peft")
FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
R = 2


def _lora_model(config, targets=TARGETS, modules=()):
    base = build_causal_lm(config)
    torch.manual_seed(7)            # random A and B (init_lora_weights=False): both learn from step one
    return peft.get_peft_model(base, peft.LoraConfig(r=R, lora_alpha=4, target_modules=list(modules),
                                                     target_parameters=targets, init_lora_weights=False))


def _check_split(model, tp: int, ep: int, what: str) -> None:
    """Every adapter on experts has this rank's share of its experts (r rows or columns each) and, under
    tp, its split factor is cut like the expert's intermediate dim; under ep it is an expert weight."""
    seen = 0
    for name, p in model.unwrap().named_parameters():
        if "experts" not in name or "lora_" not in name:
            continue
        seen += 1
        info = get_tp_info(p)
        full = info.full_shape if info is not None else tuple(p.shape)
        expert_dim = 0 if "lora_A" in name else 1
        assert p.shape[expert_dim] == full[expert_dim] // ep, (what, name, tuple(p.shape), full)
        split_dim = 1 - expert_dim
        sliced = p.shape[split_dim] != full[split_dim]
        tp_split = info is not None and info.tp_size > 1
        assert sliced == tp_split and (tp == 1) <= (not tp_split), (what, name, tuple(p.shape), full)
        assert (grad_reduction(p) is not None and grad_reduction(p).kind == "expert") == (ep > 1), (what, name)
    assert seen, f"{what}: no adapter on experts"


def _check_saved(booster, model, config, ref_model, folder: str, what: str, rank: int) -> None:
    booster.save_lora_as_pretrained(model, folder, use_safetensors=True)
    if rank == 0:
        loaded = peft.PeftModel.from_pretrained(build_causal_lm(config), folder)
        ref = dict(ref_model.named_parameters())
        adapters = [n for n, _ in loaded.named_parameters() if "lora_" in n]
        assert adapters and {n for n in ref if "lora_" in n} == set(adapters), f"{what}: adapter names differ"
        for n, p in loaded.named_parameters():
            if "lora_" in n:
                assert_close(p.detach(), ref[n].detach(), msg=f"{what}: saved {n}")
        ids = torch.arange(1, 17).view(2, 8)
        with torch.no_grad():
            want = copy.deepcopy(ref_model).merge_and_unload().eval()(input_ids=ids).logits
            got = loaded.merge_and_unload().eval()(input_ids=ids).logits
        assert_close(got, want, msg=f"{what}: merge_and_unload of the loaded folder")
    dist.barrier()


def _layouts(rank, root):
    layouts = (("tp2 zero1", HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1)), 2, 1),
               ("ep2 zero1", HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=1)), 1, 2),
               ("tp2 ep2", HybridParallelConfig(tp_size=2, ep_size=2), 2, 2))
    for family in FAMILIES:
        config = moe_config(family)
        batches = causal_batches(config, 2)
        ref_model = _lora_model(config)
        ref_losses, ref_params = train_whole(config, batches, model=ref_model)
        for name, cfg, tp, ep in layouts:
            what = f"{family} lora experts {name}"
            booster, model, _ = train_boosted(config, batches, cfg, ref_losses, ref_params, what,
                                              model=_lora_model(config))
            _check_split(model, tp, ep, what)
            if tp > 1 and ep > 1:
                _check_saved(booster, model, config, ref_model, os.path.join(root, family), what, rank)


def _starved(rank):
    config = moe_config("glm4_moe")
    batches = causal_batches(config, 2, batch=8, seed=7)

    def model():
        lora = _lora_model(config)
        for m in lora.modules():
            if hasattr(m, "e_score_correction_bias"):       # experts 0 and 1 only: ep rank 1 gets no token
                m.e_score_correction_bias.copy_(torch.tensor([4.0, 4.0, -4.0, -4.0]))
        return lora
    ref_losses, ref_params = train_whole(config, batches, model=model())
    train_boosted(config, batches, HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=2)), ref_losses, ref_params,
                  "lora experts starved ep2 zero2", model=model())


def _refused(config, plugin_config, match, **lora):
    model = _lora_model(config, **lora)
    booster = Booster(plugin=HybridParallelPlugin(plugin_config))
    with pytest.raises((ValueError, NotImplementedError), match=match):
        booster.boost(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad]))


def _bad_inputs():
    tp2 = HybridParallelConfig(tp_size=2)
    _refused(moe_config("qwen3_moe", moe_intermediate_size=33), tp2,
             r"intermediate size 33 is not divisible by tp_size=2")
    gpt_oss = moe_config("gpt_oss")
    _refused(gpt_oss, tp2, r"gate_up_proj_bias: an adapter on gate_up_proj_bias .* adapt only gate_up_proj / "
             r"down_proj", targets=["mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"])
    _refused(moe_config("qwen3_moe"), tp2, r"self_attn.q_proj: peft's target_parameters adapts \['weight'\] .* "
             r"style 'colwise'", targets=["self_attn.q_proj.weight"])
    _refused(gpt_oss, HybridParallelConfig(ep_size=4), r"ep_size=4 leaves one of the 4 experts per rank")


def _body(rank, world, root):
    _bad_inputs()
    _starved(rank)
    _layouts(rank, root)


def test_lora_on_experts(tmp_path):
    spawn(_body, 4, str(tmp_path))
