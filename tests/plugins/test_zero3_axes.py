"""ZeRO-3 (torch FSDP2) composed with pipeline and with expert parallelism (issue 40, points 1 and 2 and
their part of point 5), every layout at its smallest world in one spawn of 4, each against one process
training the same weights on the whole batches with AdamW: every step's loss (the global batch's token
mean) within 2e-5 relative in fp32, every gradient of the first step and every weight after the last
step gathered from its shards (1e-5):

* pp=2 x dp=2, Llama, 1F1B and interleaved (2 chunks per rank): each stage's weights are DTensors over
  the stage's dp ranks, and one step (2 micro-batches) all-gathers each FSDP2 unit once and
  reduce-scatters it once (the dispatcher counts them); with `reshard_after_forward=True` the same
  numbers, with more all-gathers. GPT-2 at pp=2 (its embedding tied to the LM head across the two
  stages: the reduced shards summed over the stage group), clipped by the global norm (equal to one
  process's within 1e-5, as for the clipped ep runs); LoRA at pp=2 (adapters trained, the frozen
  base sharded); bf16 and fp16 (loss-scaled) 1F1B against the fp32 run (their tolerances); tp=2 x pp=2,
  sp=2 x pp=2 (context parallelism: sharded over dp x cp) and pp=2 with activation checkpointing
  (recomputed inside the gathered step). Each pipeline run starts with a
  forward-only step, whose loss is the first step's.
* ep=2 x dp=4, Qwen3-MoE: the experts DTensors over edp (the 2 dp ranks holding the same experts), the
  router and the attention over all 4 dp ranks, clipped; GLM-4-MoE (shared experts and a dense first layer:
  dense); ep=2 x pp=2; tp=2 x ep=2 (tensor parallelism inside the experts, edp=1); ColossalAI's `MoeHybridParallelPlugin(ep_size=2, zero_stage=3)`.
* checkpoints: pp=2 ZeRO-3's save reloads by `from_pretrained` bitwise and continues at tp=2 (model and
  optimizer) as the one process does; ep=2 ZeRO-3's continues at ep=1; `save_checkpoint` /
  `load_checkpoint` resume bitwise at pp=2 and at ep=2.
The refusals (reshard_after_forward without ZeRO-3, a module mixing expert and dense weights) are rows
of tests/reliability/test_bad_inputs.py and tests/plugins/test_plugin_config.py.
"""

from __future__ import annotations

import copy
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import transformers as tfm
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshboost.distributed.profiling import dispatched_comm_counter
from meshboost.plugins import HybridParallelConfig, PipelineConfig, PrecisionConfig, ZeroConfig
from meshboost.testing import spawn
from meshboost.testing.sharded_training import boost as _boost, check_held as _check, dp_step as _step, \
    reference_run as _reference, train_and_check as _train, whole_weights as _weights
from meshboost.testing.moe import build_causal_lm, causal_batches, moe_config

peft = pytest.importorskip("peft")
STEPS = 2
LLAMA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4, vocab_size=96,
             max_position_embeddings=64, intermediate_size=64, use_cache=False, tie_word_embeddings=False)


def _zero3(pp=1, chunks=1, ep=1, precision="fp32", max_norm=0.0, **kwargs) -> HybridParallelConfig:
    pipeline = PipelineConfig(num_microbatches=2, num_model_chunks=chunks,
                              pp_style="interleaved" if chunks > 1 else "1f1b") if pp > 1 else PipelineConfig()
    return HybridParallelConfig(ep_size=ep, pp_size=pp, pipeline=pipeline, zero=ZeroConfig(stage=3),
                                precision=PrecisionConfig(precision, max_norm=max_norm), **kwargs)


def _llama(seed=0):
    torch.manual_seed(seed)
    return tfm.LlamaForCausalLM(tfm.LlamaConfig(**LLAMA)).float()


def _units(model) -> int:
    return sum(isinstance(m, FSDPModule) for m in model.unwrap().modules())


def _pipeline(rank, world):
    batches = causal_batches(tfm.LlamaConfig(**LLAMA), STEPS)
    ref = _reference(_llama(), batches)
    for chunks in (1, 2):
        what = f"pp=2 x dp=2 ZeRO-3, {chunks} chunk(s) per rank"
        plugin, booster, model, opt = _train(_zero3(pp=2, chunks=chunks), _llama, batches, ref, what)
        params = list(model.unwrap().parameters())
        assert all(isinstance(p, DTensor) and p.device_mesh.size() == plugin.dp_size for p in params), what
        for reshard, gathers in ((None, "once"), (True, "more")):
            if reshard:
                plugin, booster, model, opt = _train(_zero3(pp=2, chunks=chunks, reshard_after_forward=True), _llama,
                                                     batches, ref, what + ", reshard_after_forward=True")
            with dispatched_comm_counter(plugin.mesh) as counter:
                _step(booster, plugin, model, opt, batches[0])
            ops, units = counter.summary()["dp"]["by_op"], _units(model)
            if rank == 0:
                print(f"\n[{what}, reshard_after_forward={reshard}] {units} units here; dp collectives in one step "
                      f"of 2 micro-batches: {ops}")
            assert ops.get("reduce_scatter", 0) == units, f"{what}: {ops} for {units} units"
            assert (ops.get("all_gather", 0) == units) == (gathers == "once"), f"{what}: {ops} for {units} units"
            opt.zero_grad()


def _pipeline_models(rank, world):
    config = copy.deepcopy(tfm.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=96, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
    batches = causal_batches(config, STEPS)

    def gpt2():
        torch.manual_seed(0)
        return tfm.GPT2LMHeadModel(copy.deepcopy(config)).float()
    _train(_zero3(pp=2, max_norm=0.05), gpt2, batches, _reference(gpt2(), batches, max_norm=0.05),
           "GPT-2 tied across stages, pp=2 ZeRO-3, clipped")

    def lora():
        base = _llama()
        torch.manual_seed(7)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                         target_modules=["q_proj", "v_proj", "down_proj"]))
    llama_batches = causal_batches(tfm.LlamaConfig(**LLAMA), STEPS)
    _, _, model, _ = _train(_zero3(pp=2), lora, llama_batches, _reference(lora(), llama_batches),
                            "LoRA pp=2 ZeRO-3")
    frozen = [(n, p) for n, p in model.unwrap().named_parameters() if "lora_" not in n]
    assert frozen and all(isinstance(p, DTensor) and not p.requires_grad and p.grad is None for _, p in frozen)
    ref = _reference(_llama(), llama_batches)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        _train(_zero3(pp=2, precision=precision), _llama, llama_batches, ref, f"{precision} pp=2 ZeRO-3", dtype=dtype)
    from meshboost.shardformer import PipelineGradientCheckpointConfig
    recompute = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
    for what, kwargs in (("tp=2 x pp=2", dict(tp_size=2)), ("sp=2 x pp=2 (all_to_all)", dict(cp_size=2)),
                         ("pp=2 x dp=2, activation checkpointing", dict(gradient_checkpoint=recompute))):
        _train(_zero3(pp=2, **kwargs), _llama, llama_batches, ref, f"{what} ZeRO-3")


def _experts(rank, world):
    from meshboost.booster.plugin import MoeHybridParallelPlugin

    for family in ("qwen3_moe", "glm4_moe"):
        config = moe_config(family)
        batches = causal_batches(config, STEPS)
        make = lambda: build_causal_lm(config)          # noqa: E731
        ref = _reference(make(), batches, max_norm=0.05)
        what = f"{family} ep=2 x dp=4 ZeRO-3, clipped"
        _, _, model, _ = _train(_zero3(ep=2, max_norm=0.05), make, batches, ref, what)
        for n, p in model.unwrap().named_parameters():
            axes = p.device_mesh.mesh_dim_names
            if ".experts." in n:        # 4 experts: 2 on each ep rank, 1 on each of their 2 edp ranks
                assert axes == ("edp",) and p.to_local().shape[0] == 1, f"{family}: {n} over {axes}"
            else:
                assert axes == ("edp_ep",), f"{family}: {n} is dense, sharded over {axes}"
    config = moe_config("qwen3_moe")
    batches = causal_batches(config, STEPS)
    make = lambda: build_causal_lm(config)              # noqa: E731
    ref = _reference(make(), batches)
    _train(_zero3(ep=2, pp=2), make, batches, ref, "qwen3_moe ep=2 x pp=2 ZeRO-3")
    _train(_zero3(ep=2, tp_size=2), make, batches, ref, "qwen3_moe tp=2 x ep=2 ZeRO-3 (edp=1)")
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=3)
    _train(None, make, batches, ref, "MoeHybridParallelPlugin(ep_size=2, zero_stage=3)", plugin=plugin)


def _folder(rank) -> str:
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    return folder[0]


def _saved_and_continued(rank, make, save_config, load_config, batches, cls, what):
    """Train one step under `save_config`, save model and optimizer; rank 0's `from_pretrained` equals
    the gathered weights; a fresh model under `load_config` loads both and its second step matches
    the one process's two steps."""
    folder = _folder(rank)
    ref_losses, _, ref_weights, _ = _reference(make(), batches)
    plugin, booster, model, opt = _boost(save_config, make())
    _step(booster, plugin, model, opt, batches[0])
    opt.step(), opt.zero_grad()
    saved = _weights(model)
    booster.save_model(model, f"{folder}/model", shard=True, size_per_shard=0.01)
    booster.save_optimizer(opt, f"{folder}/optim", shard=True)
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {n: t.cpu() for n, t in saved.items()})
    everything = {n: t for part in parts for n, t in part.items()}
    if rank == 0:
        for n, p in cls.from_pretrained(f"{folder}/model").named_parameters():
            assert torch.equal(p.detach(), everything[n]), f"{what}: from_pretrained {n}"
    dist.barrier()
    plugin, booster, model, opt = _boost(load_config, make())
    booster.load_model(model, f"{folder}/model")
    booster.load_optimizer(opt, f"{folder}/optim")
    for n, w in _weights(model).items():
        assert torch.equal(w.cpu(), everything[n]), f"{what}: load_model {n}"
    got = _step(booster, plugin, model, opt, batches[1])
    assert abs(got - ref_losses[1]) <= 2e-5 * abs(ref_losses[1]), f"{what}: resumed loss {got} vs {ref_losses[1]}"
    opt.step()
    _check(_weights(model), ref_weights, f"{what}: resumed weight")


def _resumed_bitwise(rank, make, config, batches, what):
    """save_checkpoint after step 1, step 2; a fresh run (other weights) loads the checkpoint and its
    step 2 gives bitwise the same weights."""
    folder = _folder(rank)
    plugin, booster, model, opt = _boost(config, make())
    _step(booster, plugin, model, opt, batches[0])
    opt.step(), opt.zero_grad()
    booster.save_checkpoint(folder, model, opt, step=1)
    _step(booster, plugin, model, opt, batches[1])
    opt.step()
    want = _weights(model)
    plugin, booster, model, opt = _boost(config, make())
    assert booster.load_checkpoint(folder, model, opt)["step"] == 1
    _step(booster, plugin, model, opt, batches[1])
    opt.step()
    for n, w in _weights(model).items():
        assert torch.equal(w, want[n]), f"{what}: resumed {n} differs by {(w - want[n]).abs().max()}"


def _checkpoints(rank, world):
    batches = causal_batches(tfm.LlamaConfig(**LLAMA), STEPS)
    tp2 = HybridParallelConfig(tp_size=2, zero=ZeroConfig(stage=1))
    _saved_and_continued(rank, _llama, _zero3(pp=2), tp2, batches, tfm.LlamaForCausalLM, "pp=2 ZeRO-3 -> tp=2")
    _resumed_bitwise(rank, _llama, _zero3(pp=2), batches, "pp=2 ZeRO-3 save_checkpoint")
    config = moe_config("qwen3_moe")
    batches = causal_batches(config, STEPS)
    make = lambda: build_causal_lm(config)              # noqa: E731
    ep1 = HybridParallelConfig(zero=ZeroConfig(stage=1))
    _saved_and_continued(rank, make, _zero3(ep=2), ep1, batches, tfm.Qwen3MoeForCausalLM, "ep=2 ZeRO-3 -> ep=1")
    _resumed_bitwise(rank, make, _zero3(ep=2), batches, "ep=2 ZeRO-3 save_checkpoint")


def _body(rank, world):
    for part in (_pipeline, _pipeline_models, _experts, _checkpoints):
        start = time.perf_counter()
        part(rank, world)
        if rank == 0:
            print(f"[time] {part.__name__}: {time.perf_counter() - start:.1f} s", flush=True)


def test_zero3_with_pipeline_and_experts():
    spawn(_body, 4)
