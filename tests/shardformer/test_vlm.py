"""Vision-language models at tp=2 and pp=2 with their real inputs (pixel values, Qwen-VL's image grids,
image tokens in input_ids, token type ids), 4 ranks, fp32, each against one process training the
same model on the whole batches (per-step loss within 2e-5 relative, every weight after 3 AdamW
steps, gathered from its shards), for every family of `meshboost.testing.vlm` (Qwen2.5-VL, Qwen3-VL,
LLaVA, Gemma-3, Idefics3, SmolVLM, PaliGemma):

- tp=2 x dp=2 with ZeRO-1: the language model sharded by its text_config's plan (checked: q_proj split), the
  vision tower and projector whole on every rank (no plan of their own), said once.
- pp=2 x dp=2: the vision tower and projector on the first stage only (checked), the pixel inputs
  withheld from the others; micro-batches split Qwen-VL's flattened patches with their images.
  Qwen3-VL adds deepstack visual features after its first text layers, so its first stage must hold
  one more layer: refused at an even split, trained at num_layers_per_stage=[2, 1].
- tp=2 x pp=2 for Qwen2.5-VL and LLaVA; LoRA on Qwen2.5-VL (text and vision adapters) at tp=2 and pp=2.
- Refused clearly on every rank: Mllama at tp=2 (no plan anywhere), image tokens that do not match the
  images given.
"""

from __future__ import annotations

import pytest
import torch

from meshboost import Booster
from meshboost.distributed.param_info import get_tp_info
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, PipelineConfig, ZeroConfig
from meshboost.testing import spawn
from meshboost.testing.moe import train_boosted, train_whole
from meshboost.testing.vlm import VLM_FAMILIES, build_vlm, vlm_batches, vlm_config

TOWERS = ("visual", "vision_tower", "vision_model", "multi_modal_projector", "connector")


def _config(family: str):
    if family == "qwen3_vl":            # deepstack after text layer 0: the first stage holds 2 of 3 layers
        return vlm_config(family, text_config={"num_hidden_layers": 3})
    return vlm_config(family)


def _pipeline(family: str, **kwargs) -> PipelineConfig:
    split = {"num_layers_per_stage": [2, 1]} if family == "qwen3_vl" else {}
    return PipelineConfig(num_microbatches=2, **split, **kwargs)


def _tower_params(model) -> dict:
    return {n: p for n, p in model.unwrap().named_parameters()
            if any(f".{t}." in f".{n}" for t in TOWERS)}


def _layouts(rank, world):
    for family in VLM_FAMILIES:
        config = _config(family)
        batches = vlm_batches(config, 3)
        reference = build_vlm(config)
        ref_losses, _ = train_whole(config, batches, model=reference)
        ref_params = dict(reference.named_parameters(remove_duplicate=False))   # a tied head under its own name
        # ZeRO-1 over dp: LLaVA's CLIP post_layernorm feeds only the pooled output LLaVA does not read, a
        # parameter torch DDP would wait for (find_unused_parameters=True); ZeRO reduces what was produced
        _, model, _ = train_boosted(config, batches, HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1)),
                                    ref_losses, ref_params, f"{family} tp2 zero1", model=build_vlm(config))
        named = dict(model.unwrap().named_parameters())
        q = next(p for n, p in named.items() if n.endswith("layers.0.self_attn.q_proj.weight") and "vision" not in n
                 and "visual" not in n)
        assert get_tp_info(q) is not None, f"{family}: the language model's q_proj is not sharded"
        towers = _tower_params(model)
        assert towers and all(get_tp_info(p) is None for p in towers.values()), f"{family}: the tower is split"

        _, model, _ = train_boosted(config, batches, HybridParallelConfig(pp_size=2, pipeline=_pipeline(family)), ref_losses,
                                    ref_params, f"{family} pp2", model=build_vlm(config))
        towers = _tower_params(model)
        stage = model.mesh.pp_rank
        assert (len(towers) > 0) == (stage == 0), f"{family}: stage {stage} holds {len(towers)} tower weights"
        if family in ("qwen2_5_vl", "llava"):
            train_boosted(config, batches, HybridParallelConfig(tp_size=2, pp_size=2, pipeline=_pipeline(family)), ref_losses,
                          ref_params, f"{family} tp2 pp2", model=build_vlm(config))


def _lora(rank, world):
    """LoRA (peft) on Qwen2.5-VL's language model and vision MLPs: the text adapters sharded with their
    linears at tp=2 (ZeRO-1 over dp), the vision ones whole; at pp=2 every adapter with its stage."""
    peft = pytest.importorskip("peft")
    config = vlm_config("qwen2_5_vl")
    batches = vlm_batches(config, 3)

    def model():
        m = build_vlm(config)
        torch.manual_seed(7)
        return peft.get_peft_model(m, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                      target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"]))
    reference = model()
    ref_losses, _ = train_whole(config, batches, model=reference)
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    for name, cfg in (("tp2 zero1", HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1))),
                      ("pp2", HybridParallelConfig(pp_size=2, pipeline=_pipeline("qwen2_5_vl")))):
        _, boosted, _ = train_boosted(config, batches, cfg, ref_losses, ref_params, f"qwen2_5_vl lora {name}",
                                      model=model())
        if cfg.dims.tp > 1:
            split = [n for n, p in boosted.unwrap().named_parameters() if "lora_B" in n and get_tp_info(p) is not None]
            assert any("language_model" in n for n in split) and not any("visual" in n for n in split), split


def _refusals(rank, world):
    config = vlm_config("qwen3_vl", text_config={"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="the first pipeline stage must hold at least 2 of its layers"):
        Booster(plugin=HybridParallelPlugin(HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(
            num_microbatches=2)))).boost(build_vlm(config))
    import transformers as tfm
    mllama = tfm.MllamaConfig(
        text_config=dict(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, intermediate_size=64, cross_attention_layers=[1], pad_token_id=0),
        vision_config=dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, num_global_layers=1,
                           image_size=16, patch_size=8, intermediate_size=64, vision_output_dim=64,
                           intermediate_layers_indices=[0]))
    with pytest.raises(ValueError, match="no tensor-parallel policy for MllamaForConditionalGeneration"):
        Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(tfm.MllamaForConditionalGeneration(mllama))
    # image tokens that do not match the images given: the model's own error, on every rank alike
    config = vlm_config("llava")
    model, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2)).boost(build_vlm(config))
    batch = vlm_batches(config, 1)[0]
    image = config.image_token_id
    ids = batch["input_ids"].clone()
    row = ids[0]
    row[(row == image).nonzero()[0]] = 1               # one image token fewer than the image's features
    with pytest.raises(ValueError, match="(?i)image features and image tokens do not match"):
        model(**{**batch, "input_ids": ids})


def _body(rank, world):
    _refusals(rank, world)
    _layouts(rank, world)
    _lora(rank, world)


def test_vision_language_models_under_tp_and_pp():
    spawn(_body, 4)
