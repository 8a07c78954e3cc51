"""booster.enable_lora / save_lora_as_pretrained (ColossalAI's LoRA API, on HuggingFace peft), dp=2:
with TorchDDPPlugin, LowLevelZeroPlugin (ZeRO-2) and HybridParallelPlugin(tp_size=1, ZeRO-1), a tiny
Llama with LoRA adapters on q/v trains like one process training the same peft model on the whole
batch (loss per step and adapter weights after 3 AdamW steps within 1e-5; the frozen base weights
bitwise unchanged, with no fp32 master or optimizer state); the adapters saved by
save_lora_as_pretrained load with PeftModel.from_pretrained and through enable_lora(pretrained_dir=...)
to the trained values; bf16 saves the fp32 masters;
booster.load_model after boost reads the base weights from the base model's HF checkpoint (Llama, and
GPT-2 with its tied head), keeps the adapters, and then trains like peft on that base.
What is not supported is refused on every rank with the fix named: GeminiPlugin, bitsandbytes' QLoRA config (NF4 QLoRA: test_qlora.py), enable_lora after boost, a missing or wrong config. (tp, pp, sp and their refusals:
tests/plugins/test_lora_parallel.py, tests/reliability/test_bad_inputs.py.)"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.optim.memory import memory_breakdown
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.booster.plugin import GeminiPlugin
from meshboost.plugins import LowLevelZeroPlugin, TorchDDPPlugin
from meshboost.testing import spawn
from meshboost.testing.compare import train_reference
from meshboost.testing.models import build_model, tiny_config, token_batches

peft = pytest.importorskip("peft")
STEPS, LR = 3, 1e-2


def _lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _peft_model(booster=None, seed=0):
    base = build_model("LlamaForCausalLM", tiny_config("llama"), seed=seed)
    torch.manual_seed(5)                                   # lora_A's random init: the same everywhere
    if booster is None:
        return peft.get_peft_model(base, _lora_config())
    return booster.enable_lora(base, lora_config=_lora_config())


def _adapters(model) -> dict:
    return {n: p.detach().float().clone() for n, p in model.named_parameters() if "lora_" in n}


def _reference(seed=0):
    """One process training the peft model on the whole batches: (losses, adapters, the model)."""
    model = _peft_model(seed=seed)
    ref = train_reference(model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR),
                          token_batches(tiny_config("llama"), STEPS, seed=3))
    return ref.losses, _adapters(model), model


def _close(a: dict, b: dict, atol: float, what: str) -> None:
    assert a.keys() == b.keys() and a, f"{what}: adapter names differ"
    for n in a:
        assert torch.allclose(a[n], b[n], atol=atol, rtol=0), f"{what}: {n} off by {(a[n] - b[n]).abs().max():.2e}"


def _body(rank, world, root):
    ref_losses, ref_adapters, ref_model = _reference()
    base_ref = {n: p.detach().clone() for n, p in ref_model.named_parameters() if "lora_" not in n}
    rows = slice(rank * 2, rank * 2 + 2)
    plugins = {"ddp": lambda: TorchDDPPlugin(),
               "zero2": lambda: LowLevelZeroPlugin(stage=2, precision="fp32"),
               "hybrid_zero1": lambda: HybridParallelPlugin(tp_size=1, zero_stage=1, precision="fp32"),
               "hybrid_bf16": lambda: HybridParallelPlugin(tp_size=1, zero_stage=1, precision="bf16")}
    for name, make in plugins.items():
        booster = Booster(plugin=make())
        model = _peft_model(booster)
        assert isinstance(model, peft.PeftModel)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)     # frozen base included, as scripts do
        model, optimizer, *_ = booster.boost(model, optimizer)
        losses = []
        for batch in token_batches(tiny_config("llama"), STEPS, seed=3):
            loss = model(**{k: v[rows] for k, v in batch.items()}).loss
            booster.backward(loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        folder = os.path.join(root, name)
        booster.save_lora_as_pretrained(model, folder, use_safetensors=True)
        saved = peft.PeftModel.from_pretrained(build_model("LlamaForCausalLM", tiny_config("llama"), seed=0), folder)
        # masters and AdamW states exist for the adapters only (the frozen base has neither)
        lora_numel = sum(p.numel() for n, p in model.unwrap().named_parameters() if "lora_" in n)
        held = memory_breakdown(model, optimizer)
        assert held["optimizer_states"] <= 2 * 4 * lora_numel + 64, (name, held, lora_numel)
        assert held["fp32_masters"] <= (4 * lora_numel + 64 if name == "hybrid_bf16" else 0), (name, held, lora_numel)
        if name == "hybrid_bf16":                     # bf16 compute: near the fp32 run; the files hold fp32 masters
            assert all(abs(a - b) < 5e-2 for a, b in zip(losses, ref_losses)), (losses, ref_losses)
            _close(_adapters(saved), ref_adapters, 2e-2, name)
            masters = optimizer.master_weight
            for n, p in model.unwrap().named_parameters():
                if "lora_" in n:
                    master = masters(p)                   # gathered to dp rank 0 (every rank joins)
                    if rank == 0:
                        assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
                        assert torch.equal(dict(saved.named_parameters())[n].detach(), master.cpu()), n
            continue
        assert all(abs(a - b) < 1e-5 for a, b in zip(losses, ref_losses)), f"{name}: {losses} vs {ref_losses}"
        trained = _adapters(model.unwrap())
        _close(trained, ref_adapters, 1e-5, name)
        for n, p in model.unwrap().named_parameters():
            if "lora_" not in n:
                assert not p.requires_grad and torch.equal(p.detach(), base_ref[n]), f"{name}: frozen {n} changed"
        _close(_adapters(saved), trained, 0.0, f"{name} saved")
        # trainable adapters loaded back through enable_lora, then boosted again
        again = Booster(plugin=make())
        resumed = again.enable_lora(build_model("LlamaForCausalLM", tiny_config("llama"), seed=0),
                                    pretrained_dir=folder)
        assert all(p.requires_grad for n, p in resumed.named_parameters() if "lora_" in n)
        resumed, *_ = again.boost(resumed, torch.optim.AdamW(resumed.parameters(), lr=LR))
        _close(_adapters(resumed.unwrap()), trained, 0.0, f"{name} enable_lora(pretrained_dir)")

    # booster.load_model of the base model's HF checkpoint after boost (ColossalChat's lora_finetune.py):
    # base weights from the file (masters refreshed), adapters kept; trains like peft on that base
    hf_losses, hf_adapters, _ = _reference(seed=3)
    for name in ("ddp", "hybrid_zero1"):
        booster = Booster(plugin=plugins[name]())
        model = _peft_model(booster, seed=0)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        model, optimizer, *_ = booster.boost(model, optimizer)
        booster.load_model(model, os.path.join(root, "hf_llama"))
        for batch in token_batches(tiny_config("llama"), STEPS, seed=3):
            booster.backward(model(**{k: v[rows] for k, v in batch.items()}).loss, optimizer)
            optimizer.step()
            optimizer.zero_grad()
        _close(_adapters(model.unwrap()), hf_adapters, 1e-5, f"{name}: load_model(base checkpoint), then train")
    # a tied LM head (GPT-2, Conv1D attention): every base weight read from the HF checkpoint
    booster = Booster(plugin=TorchDDPPlugin())
    gpt2 = booster.enable_lora(build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=0),
                               lora_config=peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True))
    gpt2, *_ = booster.boost(gpt2)
    booster.load_model(gpt2, os.path.join(root, "hf_gpt2"))
    hf = build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=3).state_dict()
    for n, p in gpt2.unwrap().named_parameters():
        if "lora_" not in n:
            key = n.removeprefix("base_model.model.").replace(".base_layer.", ".")
            assert torch.equal(p.detach(), hf[key]), f"GPT-2 LoRA load_model: {n}"
    assert gpt2.unwrap().base_model.model.lm_head.weight is gpt2.unwrap().base_model.model.transformer.wte.weight

    # refusals: on every rank, before any collective
    base = build_model("LlamaForCausalLM", tiny_config("llama"), seed=0)
    def lora(plugin=None, **kwargs):
        return lambda: Booster(plugin=plugin).enable_lora(copy.deepcopy(base), **kwargs)

    cases = [
        (lora(GeminiPlugin(), lora_config=_lora_config()), NotImplementedError, "GeminiPlugin does not support LoRA"),
        (lora(TorchDDPPlugin()), ValueError, "lora_config"),
        (lora(TorchDDPPlugin(), lora_config={"r": 4}), TypeError, "peft.LoraConfig"),
        (lora(TorchDDPPlugin(), lora_config=_lora_config(), bnb_quantization_config=object()), NotImplementedError,
         "bitsandbytes"),
        (lora(TorchDDPPlugin(), lora_config=_lora_config(), quantize=True), ValueError,   # tiny: 16 blocks a weight
         "not a multiple of block_size=64 x scaler_block_size=256"),
        (lora(TorchDDPPlugin(), pretrained_dir=root), FileNotFoundError, "adapter_config.json"),
        (lora(None, lora_config=_lora_config()), ValueError, "needs a plugin"),
    ]
    for call, error, match in cases:
        with pytest.raises(error, match=match):
            call()
    booster = Booster(plugin=TorchDDPPlugin())
    boosted, *_ = booster.boost(copy.deepcopy(base))
    with pytest.raises(RuntimeError, match="before booster.boost"):
        booster.enable_lora(boosted, lora_config=_lora_config())
    with pytest.raises(TypeError, match="booster.enable_lora"):
        booster.save_lora_as_pretrained(boosted, os.path.join(root, "nope"))
    # a save rank 0 cannot place (the path is a file) fails on every rank, leaving the file as it was
    booster = Booster(plugin=TorchDDPPlugin())
    model, *_ = booster.boost(_peft_model(booster))
    blocker = os.path.join(root, "a_file")
    if rank == 0:
        with open(blocker, "w") as fh:
            fh.write("keep me")
    dist.barrier()
    with pytest.raises((ValueError, RuntimeError), match="is a file|rank 0 failed"):
        booster.save_lora_as_pretrained(model, blocker)
    assert open(blocker).read() == "keep me"
    assert not os.path.exists(os.path.join(root, "nope"))


def test_lora_trains_saves_and_loads_like_one_process(tmp_path):
    build_model("LlamaForCausalLM", tiny_config("llama"), seed=3).save_pretrained(tmp_path / "hf_llama")
    build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=3).save_pretrained(tmp_path / "hf_gpt2")
    spawn(_body, 2, str(tmp_path))
