"""Expert parallelism (issue 25, items 2, 3 and 5) on 4 processes, each layout against single-process
AdamW training on the whole batches from the same weights (per-step loss within 2e-5 relative in fp32,
every weight gathered from its shards after the last step):

- every MoE family of the zoo (Qwen3-MoE, Mixtral, OLMoE, GLM-4-MoE, DeepSeek-V3, GPT-OSS, Llama-4 text)
  at ep=2 over dp=4 (two replicas of each expert: expert gradients averaged over them) and at tp=2 x ep=2
  (tensor parallelism inside each expert), each rank holding 1/(ep x tp) of every expert tensor;
- Qwen3-MoE at ep=2 x pp=2 (1F1B), ep=2 with ZeRO-1 in bf16 (its save reloaded by `from_pretrained`),
  ZeRO-2 in fp16, clipped by the global gradient norm (DDP, and tp=2 x ep=2 with ZeRO-1: the norm
  one process computes), the router's load-balancing loss at ep=2 (DDP's semantics, the default), and with its
  routing statistics all-reduced over dp (`router_statistics="global"`: one process on the whole batch);
- a router forced to starve the second ep rank (no token reaches its experts) at ep=2 with DDP and with
  ZeRO-2, the hang ColossalAI avoids by turning ZeRO-2 off: no hang and the same numbers;
- checkpoints across layouts: model and optimizer saved at ep=2 (ZeRO-1) continue at tp=2, and saved at
  tp=2 continue at ep=2;
- a checkpoint with another expert count refused (the other bad inputs of expert parallelism are rows
  of tests/reliability/test_bad_inputs.py).
One process group, the layouts looped inside."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import transformers

from meshboost.distributed.param_info import EXPERT, get_tp_info, grad_reduction
from meshboost.plugins import (
    HybridParallelConfig,
    HybridParallelPlugin,
    PipelineConfig,
    PrecisionConfig,
    ZeroConfig,
)
from meshboost.shardformer.layers.expert_parallel import experts_modules
from meshboost.shardformer.layers.experts import experts_forward
from meshboost.testing import assert_close, spawn
from meshboost.testing.moe import MOE_FAMILIES, build_causal_lm, causal_batches, moe_config, train_boosted, train_whole

STEPS = 2


def _check_split(model, ep, tp, what):
    """Every expert tensor is split over ep (and, where tensor parallelism cuts it, over tp inside each expert):
    this rank holds 1/(ep x tp) of it, recorded as an expert weight."""
    experts = [(n, p) for n, p in model.unwrap().named_parameters() if ".experts." in n]
    assert experts, what
    for n, p in experts:
        info = get_tp_info(p)
        assert grad_reduction(p).kind == EXPERT and info.expert_size == ep, f"{what}: {n} is not split over ep"
        full = torch.Size(info.full_shape).numel()
        split = ep * info.tp_size
        assert p.numel() * split == full, f"{what}: {n} holds {p.numel()} of {full} elements, not 1/{split}"
    for path, module in experts_modules(model.unwrap()):     # one record decides the forward, nothing replayed
        record = experts_forward(module)
        assert record.ep is not None and (record.tp is not None) == (tp > 1), f"{what}: {path} {record}"
        assert not module._forward_pre_hooks and not module._forward_hooks, f"{what}: {path} kept tp's hooks"


def _families(rank):
    for family in MOE_FAMILIES:
        config = moe_config(family)
        batches = causal_batches(config, STEPS, batch=8, seed=7)
        ref_losses, ref_params = train_whole(config, batches)
        for what, plugin_config in ((f"{family} ep2 dp4", HybridParallelConfig(ep_size=2)),
                                    (f"{family} tp2 ep2", HybridParallelConfig(tp_size=2, ep_size=2))):
            booster, model, _ = train_boosted(config, batches, plugin_config, ref_losses, ref_params, what)
            _check_split(model, 2, plugin_config.dims.tp, what)
        if family == "gpt_oss":          # biases, interleaved gate/up: the tp2 x ep2 save is the HF layout
            _reload(booster, model, ref_params, torch.float32, family)


def _reload(booster, model, ref_params, dtype, what):
    """save_model's folder, loaded by transformers' from_pretrained, holds the reference's weights."""
    folder = os.path.join(tempfile.gettempdir(), f"meshboost_moe_ep_{os.environ.get('MASTER_PORT', '0')}_{what}")
    booster.save_model(model, folder, shard=True)        # gathered over dp, tp, ep (and stages)
    dist.barrier()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for n, p in reloaded.named_parameters():
        assert_close(p.detach(), ref_params[n].detach(), dtype=dtype, msg=f"{what} reloaded {n}")


def _qwen_layouts(rank):
    config = moe_config("qwen3_moe")
    batches = causal_batches(config, STEPS, batch=8, seed=7)
    ref_losses, ref_params = train_whole(config, batches)
    booster, model, _ = train_boosted(config, batches, HybridParallelConfig(
        ep_size=2, pp_size=2, pipeline=PipelineConfig(num_microbatches=2)), ref_losses, ref_params, "ep2 pp2")
    _reload(booster, model, ref_params, torch.float32, "ep2_pp2")       # each stage writes its experts
    booster, model, _ = train_boosted(config, batches, HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=1),
                                                                            precision=PrecisionConfig("bf16")),
                                      ref_losses, ref_params, "ep2 zero1 bf16", dtype=torch.bfloat16)
    _reload(booster, model, ref_params, torch.bfloat16, "ep2_zero1_bf16")   # the fp32 masters
    train_boosted(config, batches, HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=2),
                                                        precision=PrecisionConfig("fp16")),
                  ref_losses, ref_params, "ep2 zero2 fp16", dtype=torch.float16)
    # clipped by the global gradient norm: every expert shard counted once (disjoint over ep, replicated
    # over edp), the norm itself equal to one process's
    norms = []
    clipped_losses, clipped_params = train_whole(config, batches, max_norm=0.05, norms=norms)
    assert all(n > 0.05 for n in norms), norms                 # the clip is active
    for what, plugin_config in (("ep2 clipped", HybridParallelConfig(ep_size=2, precision=PrecisionConfig(
                                    max_norm=0.05))),
                                ("tp2 ep2 zero1 clipped", HybridParallelConfig(
                                    tp_size=2, ep_size=2, zero=ZeroConfig(stage=1),
                                    precision=PrecisionConfig(max_norm=0.05)))):
        train_boosted(config, batches, plugin_config, clipped_losses, clipped_params, what, ref_norms=norms)
    # the router's load-balancing loss: each replica's own by default (DDP's semantics) ...
    routed = moe_config("qwen3_moe", output_router_logits=True)
    replica_losses, replica_params = train_whole(routed, batches, replicas=4)
    train_boosted(routed, batches, HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=1)), replica_losses,
                  replica_params, "ep2 router loss (replicas')")
    # ... or, with the routing statistics all-reduced over dp, the whole batch's
    whole_losses, whole_params = train_whole(routed, batches)
    train_boosted(routed, batches, HybridParallelConfig(ep_size=2, router_statistics="global"), whole_losses,
                  whole_params, "ep2 router loss (global statistics)")


def _starved(config):
    """GLM-4-MoE whose router always picks experts 0 and 1 (its selection bias), which live on ep rank 0:
    ep rank 1's experts receive no token in any step."""
    model = build_causal_lm(config)
    for m in model.modules():
        if hasattr(m, "e_score_correction_bias"):
            m.e_score_correction_bias.copy_(torch.tensor([4.0, 4.0, -4.0, -4.0]))
    return model


def _starvation(rank):
    config = moe_config("glm4_moe")
    batches = causal_batches(config, STEPS, batch=8, seed=7)
    reference = _starved(config)
    picked = []
    for m in reference.modules():
        if type(m).__name__.endswith("Experts"):
            m.register_forward_pre_hook(lambda mod, args: picked.append(args[1].unique()))
    ref_losses, ref_params = train_whole(config, batches, model=reference)
    assert picked and set(torch.cat(picked).tolist()) == {0, 1}, "the router was meant to pick experts 0 and 1 only"
    for what, plugin_config in (("starved ep2 ddp", HybridParallelConfig(ep_size=2)),
                                ("starved ep2 zero2", HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=2)))):
        train_boosted(config, batches, plugin_config, ref_losses, ref_params, what, model=_starved(config))


def _checkpoints(rank):
    """Model and optimizer saved in one layout continue training in another: the weights after the
    second step are those of two single-process steps."""
    config = moe_config("qwen3_moe")
    batches = causal_batches(config, 2, batch=8, seed=7)
    first_losses, first_params = train_whole(config, batches[:1])
    ref_losses, ref_params = train_whole(config, batches)
    port = os.environ.get("MASTER_PORT", "0")
    for what, saved_in, loaded_in in (("ep2 -> tp2", HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=1)),
                                       HybridParallelConfig(tp_size=2)),
                                      ("tp2 -> ep2", HybridParallelConfig(tp_size=2),
                                       HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=1)))):
        folder = os.path.join(tempfile.gettempdir(), f"meshboost_moe_ep_ckpt_{port}_{what[:3]}")
        booster, model, opt = train_boosted(config, batches[:1], saved_in, first_losses, first_params,
                                            f"{what} (first step)")
        booster.save_model(model, os.path.join(folder, "model"), shard=True)
        booster.save_optimizer(opt, os.path.join(folder, "optim"), shard=True)

        def load(booster, model, opt):
            booster.load_model(model, os.path.join(folder, "model"))
            booster.load_optimizer(opt, os.path.join(folder, "optim"))
        train_boosted(config, batches[1:], loaded_in, ref_losses[1:], ref_params, f"{what} (second step)",
                      setup=load)
    # a checkpoint of 4 experts does not load into a model of 8
    eight = build_causal_lm(moe_config("qwen3_moe", num_experts=8))
    from meshboost import Booster

    booster = Booster(plugin=HybridParallelPlugin(HybridParallelConfig(ep_size=2)))
    eight, *_ = booster.boost(eight)
    with pytest.raises(ValueError, match="another configuration"):
        booster.load_model(eight, os.path.join(folder, "model"))


def _body(rank, world):
    _families(rank)
    _qwen_layouts(rank)
    _starvation(rank)
    _checkpoints(rank)


def test_expert_parallel_layouts():
    spawn(_body, 4)


def test_expert_parallel_config_refusals():
    HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=3))     # runs: tests/plugins/test_zero3_axes.py
    with pytest.raises(ValueError, match="ep_size=0 must be a positive integer"):
        HybridParallelConfig(ep_size=0)
