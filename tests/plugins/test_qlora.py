"""QLoRA (`booster.enable_lora(..., quantize=QuantConfig(...))`: the adapted linears' frozen bases in torchao's NF4)
in one spawn of 2, fp32 adapters, each layout against one process training the same quantized peft model
(`quantize_bases_` on one process: torchao's `to_nf4` of the unsharded weights), per-step loss within 2e-5
relative, the first step's adapter gradients and every adapter after 3 AdamW steps:

- tp=2 (q/k/v/gate/up column-parallel: NF4 cut by rows; o/down row-parallel: cut by columns on whole
  quantization blocks), tp=2 with sequence parallelism, dp=2 with ZeRO-1, and plain LoRA's bf16 working
  precision (the NF4 bases survive the cast: torchao's `.to(dtype)` would dequantize them);
- every rank's base weights stay NF4 after training, the shards hold the unsharded quantization's own
  4-bit codes and scales (dequantized bytes identical to torchao's `to_nf4` of the whole weight), and the
  quantized bytes are under 30% of the bf16 weight's;
- refused, on every rank, before any collective: bitsandbytes' config, a weight the scale groups do not
  divide, DoRA, a trainable base, and a tp split that would cut a quantization block.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import transformers as tfm
from torch.distributed.tensor import DTensor

from meshboost import Booster
from meshboost.booster.qlora import QuantConfig, quantize_bases_
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.distributed.quantized import dequantized, is_nf4
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, PipelineConfig, ZeroConfig
from meshboost.testing import spawn
from meshboost.testing.moe import COMMON, causal_batches, train_boosted, train_whole

peft = pytest.importorskip("peft")
pytest.importorskip("torchao")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# hidden 128 so that a row-parallel shard's 64 columns are one quantization block; 4 kv heads of 32
CONFIG = dict(COMMON, hidden_size=128, intermediate_size=256, num_key_value_heads=4)
QUANT = QuantConfig(block_size=64, scaler_block_size=16)


def _lora_config(**kwargs):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **kwargs)


def _base(config):
    torch.manual_seed(0)
    return tfm.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def _reference(config):
    """One process: peft's model, its bases quantized by torchao on the unsharded weights."""
    torch.manual_seed(7)
    model = peft.get_peft_model(_base(config), _lora_config())
    quantize_bases_(model, QUANT)
    return model


def _boosted_model(config, plugin_config):
    booster = Booster(plugin=HybridParallelPlugin(plugin_config))
    torch.manual_seed(7)
    return booster.enable_lora(_base(config), lora_config=_lora_config(), quantize=QUANT)


def _check_quantized(model, ref, what, stages):
    """Every adapted base is NF4 on this rank, its shard the unsharded quantization's bytes, and small."""
    quantized = 0
    ref_bases = {n: p for n, p in ref.named_parameters() if n.endswith("base_layer.weight")}
    for n, p in model.unwrap().named_parameters():
        if not n.endswith("base_layer.weight"):
            continue
        local = p.to_local() if isinstance(p, DTensor) else p          # ZeRO-3: FSDP2 shards the NF4 tensor
        assert is_nf4(local), f"{what}: {n} is a {type(local).__name__}, not NF4"
        full = gather_tensor((p.full_tensor() if isinstance(p, DTensor) else p).detach(), get_tp_info(p))
        assert torch.equal(full, dequantized(ref_bases[n])), f"{what}: {n} does not dequantize to torchao's values"
        held = local.quantized_data.numel() + local.quantized_scalers.numel() + 4 * local.quantization_factor.numel()
        assert held < 0.3 * 2 * local.numel(), f"{what}: {n} holds {held} bytes for {local.numel()} weights"
        quantized += 1
    assert quantized == 7 * CONFIG["num_hidden_layers"] // stages, (what, quantized)   # this stage's layers


def _check_saved(booster, model, config, ref, folder, what):
    """The adapters' peft folder loads on the unquantized base (and quantizes there to the boosted model); the
    whole model saved and loaded back into a fresh QLoRA model keeps its NF4 bytes; another base is refused."""
    booster.save_lora_as_pretrained(model, f"{folder}/adapter", use_safetensors=True)
    booster.save_model(model, f"{folder}/model", shard=False, use_safetensors=True)
    mine = {n: gather_tensor((p.full_tensor() if isinstance(p, DTensor) else p).detach(), get_tp_info(p))
            for n, p in model.unwrap().named_parameters() if "lora_" in n}
    if dist.get_rank() == 0:
        loaded = peft.PeftModel.from_pretrained(_base(config), f"{folder}/adapter")
        saved = {n: p for n, p in loaded.named_parameters() if "lora_" in n}
        assert saved.keys() == mine.keys(), what
        assert all(torch.equal(saved[n], mine[n]) for n in saved), f"{what}: the saved adapters differ"
    dist.barrier()
    again = Booster(plugin=HybridParallelPlugin(booster.plugin.config))
    fresh, *_ = again.boost(_boosted_model(config, booster.plugin.config))
    again.load_model(fresh, f"{folder}/model")
    for (n, p), q in zip(fresh.unwrap().named_parameters(), model.unwrap().parameters()):
        local, want = (p.to_local(), q.to_local()) if isinstance(p, DTensor) else (p, q)
        if is_nf4(local):
            assert torch.equal(local.quantized_data, want.quantized_data), f"{what}: {n} re-quantized on load"
    other = tfm.LlamaConfig(**CONFIG)
    torch.manual_seed(1)
    model_b = booster.enable_lora(tfm.AutoModelForCausalLM.from_config(other).float(), lora_config=_lora_config(),
                                  quantize=QUANT)
    other_booster = Booster(plugin=HybridParallelPlugin(booster.plugin.config))
    model_b, *_ = other_booster.boost(model_b)
    with pytest.raises(ValueError, match="frozen NF4 base .QLoRA. whose 4-bit values differ"):
        other_booster.load_model(model_b, f"{folder}/model")


def _layouts(rank, root):
    config = tfm.LlamaConfig(**CONFIG)
    batches = causal_batches(config, 3)
    ref = _reference(config)
    first = []
    ref_losses, ref_params = train_whole(config, batches, model=ref, first=first)
    ref_params = {n: dequantized(p) for n, p in ref_params.items()}
    for what, plugin_config in [
        ("tp2", HybridParallelConfig(tp_size=2)),
        ("tp2 sp", HybridParallelConfig(tp_size=2, sequence_parallel=True)),
        ("dp2 zero1", HybridParallelConfig(zero=ZeroConfig(stage=1))),
        ("pp2", HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2))),
        ("cp2", HybridParallelConfig(cp_size=2, cp_mode="all_to_all")),
        ("dp2 zero3", HybridParallelConfig(zero=ZeroConfig(stage=3))),
    ]:
        booster, model, _ = train_boosted(config, batches, plugin_config, ref_losses, ref_params, f"qlora {what}",
                                    model=_boosted_model(config, plugin_config), ref_first=first[0])
        _check_quantized(model, ref, what, plugin_config.dims.pp)
        if what in ("tp2", "dp2 zero3"):
            _check_saved(booster, model, config, ref, f"{root}/{what.replace(' ', '_')}", what)


def _bf16_keeps_nf4(rank):
    config = tfm.LlamaConfig(**CONFIG | dict(num_hidden_layers=1))
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, precision="bf16"))
    torch.manual_seed(7)
    model = booster.enable_lora(_base(config), lora_config=_lora_config(), quantize=QUANT)
    model, *_ = booster.boost(model)
    bases = [p for n, p in model.unwrap().named_parameters() if n.endswith("base_layer.weight")]
    assert bases and all(is_nf4(p) for p in bases), "the bf16 cast dequantized an NF4 base"
    assert all(p.dtype == torch.bfloat16 for n, p in model.unwrap().named_parameters() if "lora_" in n)


def _bad_inputs(rank):
    config = tfm.LlamaConfig(**CONFIG | dict(num_hidden_layers=1))
    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(tp_size=2)))
    with pytest.raises(NotImplementedError, match="bitsandbytes"):
        booster.enable_lora(_base(config), lora_config=_lora_config(), bnb_quantization_config=object())
    with pytest.raises(ValueError, match="scaler_block_size=1000"):
        booster.enable_lora(_base(config), lora_config=_lora_config(), quantize=QuantConfig(scaler_block_size=1000))
    with pytest.raises(NotImplementedError, match="use_dora"):
        booster.enable_lora(_base(config), lora_config=_lora_config(use_dora=True), quantize=QUANT)
    with pytest.raises(ValueError, match=r"quantize='int3'\): pass True"):
        booster.enable_lora(_base(config), lora_config=_lora_config(), quantize="int3")
    small = tfm.LlamaConfig(**CONFIG | dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128))
    model = booster.enable_lora(_base(small), lora_config=_lora_config(), quantize=QUANT)
    with pytest.raises(ValueError, match="cut its quantization blocks of 64"):
        booster.boost(model)                    # o_proj's 32-column shards would cut 64-element blocks


def _body(rank, world, root):
    _bad_inputs(rank)
    _bf16_keeps_nf4(rank)
    _layouts(rank, root)


def test_qlora_layouts(tmp_path):
    spawn(_body, 2, str(tmp_path))


def test_trainable_base_refused():
    model = peft.get_peft_model(_base(tfm.LlamaConfig(**CONFIG | dict(num_hidden_layers=1))), _lora_config())
    model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match="q_proj.base_layer.weight is trainable"):
        quantize_bases_(model, QUANT)
