"""LoRA (HuggingFace peft) under tensor and pipeline parallelism, 4 ranks, fp32, each layout against one
process training the same peft model on the whole batches (per-step loss within 2e-5 relative, the first
step's adapter gradients gathered from their shards and global gradient norm, every adapter and frozen
base weight after 3 AdamW steps, gathered from its shards):

- Llama (grouped-query attention) with adapters on every linear (q, k, v, o, gate, up, down), random
  lora_B so lora_A learns from step one: tp=2 x dp=2 with ZeRO-1 through `booster.enable_lora`, tp=2
  with sequence parallelism and ZeRO-2, pp=2 x dp=2, tp=2 x pp=2, context parallelism (sp=2 all_to_all,
  ring_attn with ZeRO-1, tp=2 x sp=2); GPT-2 (Conv1D, fused c_attn,
  fan_in_fan_out) at tp=2. lora_B of column-parallel linears and lora_A of row-parallel ones are
  sharded (checked), and adding no collective to the base's: the same all-reduce count per step.
- The frozen base keeps no gradient, no fp32 master and no optimizer state.
- `save_lora_as_pretrained` at tp=2, pp=2 and tp=2 x pp=2 writes the peft folder one process writes
  (the gathered adapters, bitwise; the one-process adapters within 1e-5), `PeftModel.from_pretrained`
  loads it; `merge_and_unload()` of the boosted model gives the merged model's logits.
- lora_dropout at tp=4: on column-parallel linears every tp rank draws the same mask on the input they
  all hold; on row-parallel ones each rank masks its slice of the features from its own stream (the
  masks differ); activation checkpointing recomputes the same masks (training bitwise equal with and
  without it).
"""

from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import transformers as tfm

from meshboost import Booster
from meshboost.distributed.profiling import comm_counter
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.optim.memory import memory_breakdown
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin, PipelineConfig, ZeroConfig
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import tiny_config
from meshboost.testing.moe import COMMON, LR, EPS, causal_batches, train_boosted, train_whole

import pytest

peft = pytest.importorskip("peft")
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
COLUMNS = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]


def _base(config, seed=0):
    torch.manual_seed(seed)
    return tfm.AutoModelForCausalLM.from_config(copy.deepcopy(config)).float()


def _lora_config(targets, dropout=0.0, **kwargs):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout,
                           init_lora_weights=False, **kwargs)


def _lora_model(config, targets=LLAMA_TARGETS, dropout=0.0, booster=None, **kwargs):
    base = _base(config)
    torch.manual_seed(7)                       # the adapters' random init: the same everywhere
    if booster is not None:
        return booster.enable_lora(base, lora_config=_lora_config(targets, dropout, **kwargs))
    return peft.get_peft_model(base, _lora_config(targets, dropout, **kwargs))


def _adapters_gathered(model) -> dict:
    """This rank's adapters, gathered over tp (the stage's; every rank joins)."""
    return {n: gather_tensor(p.detach(), get_tp_info(p)) for n, p in model.unwrap().named_parameters()
            if "lora_" in n}


def _check_layout(model, optimizer, what: str, tp: int) -> None:
    """The adapters are sharded with their base; the frozen base holds nothing for training."""
    inner = model.unwrap()
    split = {n: get_tp_info(p) for n, p in inner.named_parameters() if "lora_" in n}
    for n, info in split.items():
        column = any(f".{c}." in n for c in COLUMNS + ["c_attn", "c_fc"])
        if tp > 1:
            want = ("lora_B" in n) if column else ("lora_A" in n)
            assert (info is not None) == want, f"{what}: {n} sharded={info is not None}, expected {want}"
    lora_numel = sum(p.numel() for n, p in inner.named_parameters() if "lora_" in n)
    held = memory_breakdown(model, optimizer)
    assert held["fp32_masters"] == 0, (what, held)
    assert held["optimizer_states"] <= 2 * 4 * lora_numel + 64, (what, held, lora_numel)
    for n, p in inner.named_parameters():
        if "lora_" not in n:
            assert not p.requires_grad and p.grad is None, f"{what}: frozen {n} holds a gradient"


def _check_saved(booster, model, folder, config, ref_adapters, what: str, rank: int) -> None:
    booster.save_lora_as_pretrained(model, folder, use_safetensors=True)
    gathered = {}
    for n, t in _adapters_gathered(model).items():
        gathered[n] = t.cpu()
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, gathered)             # every stage's adapters
    if rank == 0:
        everything = {n: t for part in parts for n, t in part.items()}
        loaded = peft.PeftModel.from_pretrained(_base(config), folder)
        saved = {n: p.detach() for n, p in loaded.named_parameters() if "lora_" in n}
        assert saved.keys() == ref_adapters.keys() == everything.keys(), f"{what}: adapter names differ"
        for n in saved:
            assert torch.equal(saved[n], everything[n]), f"{what}: saved {n} is not the gathered adapter {(saved[n]-everything[n]).abs().max()} {(saved[n]-ref_adapters[n]).abs().max()} {(everything[n]-ref_adapters[n]).abs().max()}"
            assert_close(saved[n], ref_adapters[n], msg=f"{what}: saved {n}")
    dist.barrier()


def _layouts(rank, world, root):
    config = tfm.LlamaConfig(**COMMON)
    batches = causal_batches(config, 3)
    ref_model = _lora_model(config)
    first = []                                 # the first step's gradients: every layout's must equal them
    ref_losses, ref_params = train_whole(config, batches, model=ref_model, first=first)
    ref_adapters = {n: p.detach() for n, p in ref_params.items() if "lora_" in n}

    # tp=2 x dp=2, ZeRO-1, through booster.enable_lora (ColossalAI's path)
    plugin_config = HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1))
    enabler = Booster(plugin=HybridParallelPlugin(plugin_config))
    booster, model, opt = train_boosted(config, batches, plugin_config, ref_losses, ref_params, "lora tp2 zero1",
                                        model=_lora_model(config, booster=enabler), ref_first=first[0])
    _check_layout(model, opt, "tp2", 2)
    _check_saved(booster, model, os.path.join(root, "tp2"), config, ref_adapters, "tp2", rank)
    # merge_and_unload on the boosted model: the merged model's logits (eval returns whole logits)
    ids = batches[0]["input_ids"]
    merged_ref = copy.deepcopy(ref_model).merge_and_unload().eval()
    with torch.no_grad():
        want = merged_ref(input_ids=ids).logits
        model.eval()
        before = model(input_ids=ids).logits
        merged = model.unwrap().merge_and_unload()
        after = model(input_ids=ids).logits
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    assert_close(before, want, msg="boosted LoRA eval logits")
    assert_close(after, want, msg="boosted merge_and_unload logits")

    # no collective added to the base's: forward, the same tp all-reduces with adapters on every linear as
    # without; backward, no more activation-sized ones (the frozen embedding needs no input gradient at the
    # first layer), plus one gradient sum per replicated adapter (lora_A of columns, lora_B of rows)
    counted = {}
    for name, make in (("lora", lambda: _lora_model(config)), ("plain", lambda: _base(config))):
        m = make()
        b = Booster(plugin=HybridParallelPlugin(tp_size=2))
        m, o, *_ = b.boost(m, torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=LR))
        with comm_counter(b.plugin.mesh) as forward:
            loss = m(**{k: v[:2] for k, v in batches[0].items()}).loss
        with comm_counter(b.plugin.mesh) as backward:
            b.backward(loss, o)
        replicated = [p for n, p in m.unwrap().named_parameters() if "lora_" in n and get_tp_info(p) is None]
        counted[name] = (forward.summary()["tp"], backward.summary()["tp"]["bytes_by_op"]["all_reduce"],
                         backward.summary()["tp"]["by_op"]["all_reduce"], replicated)
    lora, plain = counted["lora"], counted["plain"]
    adapter_bytes = sum(4 * p.numel() for p in lora[3])
    assert len(lora[3]) == len(LLAMA_TARGETS) * config.num_hidden_layers and lora[0] == plain[0], counted
    assert lora[1] - adapter_bytes <= plain[1] and lora[2] - len(lora[3]) <= plain[2], counted

    # tp=2 with sequence parallelism, ZeRO-2 over the adapters
    train_boosted(config, batches, HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=2),
        sequence_parallel=True), ref_losses, ref_params, "lora tp2 sp zero2", model=_lora_model(config),
        ref_first=first[0])
    # pipeline stages, then tp x pp; each saves its peft folder
    for name, cfg in (("pp2", HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2),
                                                   zero=ZeroConfig(stage=1))),
                      ("tp2pp2", HybridParallelConfig(tp_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2)))):
        booster, model, opt = train_boosted(config, batches, cfg, ref_losses, ref_params, f"lora {name}",
                                            model=_lora_model(config), ref_first=first[0])
        _check_layout(model, opt, name, cfg.dims.tp)
        _check_saved(booster, model, os.path.join(root, name), config, ref_adapters, name, rank)

    # context parallelism: the adapters replicated over cp like every weight, averaged over dp x cp
    for name, cfg in (("sp2 all_to_all", HybridParallelConfig(cp_size=2, cp_mode="all_to_all")),
                      ("sp2 ring_attn", HybridParallelConfig(cp_size=2, cp_mode="ring_attn", zero=ZeroConfig(stage=1))),
                      ("tp2 sp2", HybridParallelConfig(tp_size=2, cp_size=2, cp_mode="all_to_all"))):
        train_boosted(config, batches, cfg, ref_losses, ref_params, f"lora {name}", model=_lora_model(config),
                      ref_first=first[0])

    # GPT-2: Conv1D weights, the fused q/k/v column (c_attn), fan_in_fan_out
    gpt2 = tiny_config("gpt2")
    targets = ["c_attn", "c_proj", "c_fc"]
    g_batches = causal_batches(gpt2, 3)
    g_first = []
    g_losses, g_params = train_whole(gpt2, g_batches, model=_lora_model(gpt2, targets, fan_in_fan_out=True),
                                     first=g_first)
    _, model, opt = train_boosted(gpt2, g_batches, HybridParallelConfig(tp_size=2), g_losses, g_params,
                                  "lora gpt2 tp2", model=_lora_model(gpt2, targets, fan_in_fan_out=True),
                                  ref_first=g_first[0])
    _check_layout(model, opt, "gpt2 tp2", 2)


def _seeded_run(config, batches, plugin_config, checkpoint=False, watch=None):
    """Three AdamW steps with lora_dropout=0.25 on every linear, each step's masks seeded; (losses,
    adapters gathered). watch: {module path suffix: list} collecting the first forward's dropout outputs."""
    model = _lora_model(config, LLAMA_TARGETS, dropout=0.25)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for suffix, seen in (watch or {}).items():
        module = model.get_submodule(f"base_model.model.model.layers.0.{suffix}.lora_dropout.default")
        module.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out.detach().clone()))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS)
    booster = Booster(plugin=HybridParallelPlugin(plugin_config))
    model, opt, *_ = booster.boost(model, opt)
    model.train()
    losses = []
    for step, batch in enumerate(batches):
        torch.manual_seed(100 + step)
        loss = model(**batch).loss
        booster.backward(loss, opt)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    adapters = {n: gather_tensor(p.detach(), get_tp_info(p)) for n, p in model.unwrap().named_parameters()
                if "lora_" in n}
    return losses, adapters, booster


def _dropout(rank, world):
    config = tfm.LlamaConfig(**COMMON)
    batches = causal_batches(config, 3)
    tp4 = HybridParallelConfig(tp_size=4)
    watch = {"self_attn.q_proj": [], "self_attn.o_proj": []}
    plain_losses, plain, booster = _seeded_run(config, batches, tp4, watch=watch)
    group = booster.plugin.tp_group
    # a column adapter reads the input every rank holds: every rank draws the same mask on it
    column = watch["self_attn.q_proj"][0]
    everyone = [torch.empty_like(column) for _ in range(world)]
    dist.all_gather(everyone, column, group=group)
    assert all(torch.equal(everyone[0], other) for other in everyone[1:]), "column lora_dropout masks differ over tp"
    assert 0.1 < (column == 0).float().mean() < 0.4                         # about p of the inputs dropped
    # a row adapter reads this rank's slice of the features: each rank masks it from its own stream
    row = (watch["self_attn.o_proj"][0] == 0).float()
    everyone = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(everyone, row, group=group)
    assert not any(torch.equal(everyone[0], other) for other in everyone[1:]), "row lora_dropout masks repeat over tp"
    assert 0.1 < row.mean() < 0.4
    # activation checkpointing recomputes the same masks (both streams): the same training, bitwise
    ck_losses, recomputed, _ = _seeded_run(config, batches, tp4, checkpoint=True)
    assert plain_losses == ck_losses, (plain_losses, ck_losses)
    for n in plain:
        assert torch.equal(plain[n], recomputed[n]), f"checkpointed lora_dropout: {n}"


def _body(rank, world, root):
    _layouts(rank, world, root)
    _dropout(rank, world)


def test_lora_under_tensor_and_pipeline_parallelism(tmp_path):
    spawn(_body, 4, str(tmp_path))
