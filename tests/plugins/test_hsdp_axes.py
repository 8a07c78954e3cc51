"""HSDP composed with pipeline and with expert parallelism (issue 40 point 4): HybridParallelPlugin(zero_stage=3,
dp_replicate_size=2) with pp_size=2 and with ep_size=2, each at its smallest world in one spawn of 4, each
against one process training the same weights on the whole batches with AdamW: every step's loss within
2e-5 relative in fp32, every gradient of the first step and every weight after the last step gathered
from its shards (1e-5):

* pp=2 x 2 replicas (a tiny Llama, 1F1B over 2 micro-batches; dp_shard=1, the smallest world with both
  axes): each stage's weights are DTensors on its (dp_replicate, dp_shard) mesh, the two replicas hold
  the same pieces, and one step all-reduces each FSDP2 unit's gradient over the replicas once (not once
  per micro-batch: the dispatcher counts them). A forward-only step first gives the first step's loss.
  GPT-2 at pp=2 x 2 replicas (its embedding tied to the LM head across the stages), clipped by the global
  norm over stages, ties and replicas (one process's within 1e-5).
* ep=2 x 2 replicas, Qwen3-MoE (dp=4: dp_shard = edp_shard x ep = 1 x 2), clipped by the global norm
  (one process's within 1e-5: each shard counted once, on the first replica group): the experts on the
  (dp_replicate, edp_shard) mesh, the attention and the routers on (dp_replicate, edp_shard x ep), as
  torchtitan lays out dp_replicate x dp_shard with ep borrowed from dp_shard; the same run through
  ColossalAI's `MoeHybridParallelPlugin(ep_size=2, zero_stage=3, dp_replicate_size=2)`.
* checkpoint: the ep=2 HSDP run's model and optimizer load into plain dp=4 (ep=1, ZeRO-1) exactly, weight
  for weight and moment for moment, and its next step matches the one process's.
The bad layouts (dp_replicate_size not dividing the experts' dp / ep, ZeRO-1/2, cpu_offload) are rows of
tests/reliability/test_bad_inputs.py and tests/test_mesh.py.
"""

from __future__ import annotations

import tempfile
import time

import torch
import torch.distributed as dist
import transformers as tfm
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from meshboost.distributed.profiling import dispatched_comm_counter
from meshboost.plugins import HybridParallelConfig, PipelineConfig, PrecisionConfig, ZeroConfig
from meshboost.testing import spawn
from meshboost.testing.sharded_training import boost as _boost, check_held as _check, dp_step as _step, \
    reference_run as _reference, train_and_check as _train, whole as _whole
from meshboost.testing.moe import build_causal_lm, causal_batches, moe_config

STEPS = 2
LLAMA = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=96,
             max_position_embeddings=64, intermediate_size=64, use_cache=False, tie_word_embeddings=False)


def _hsdp(pp=1, ep=1, max_norm=0.0) -> HybridParallelConfig:
    pipeline = PipelineConfig(num_microbatches=2) if pp > 1 else PipelineConfig()
    return HybridParallelConfig(ep_size=ep, pp_size=pp, pipeline=pipeline, zero=ZeroConfig(stage=3), dp_replicate_size=2,
                                precision=PrecisionConfig("fp32", max_norm=max_norm))


def _replicas_agree(model, opt, plugin, what) -> None:
    """Both replica groups hold the same pieces of every weight and AdamW moment."""
    group = plugin.mesh.group("dp_replicate")
    for p in model.unwrap().parameters():
        assert p.device_mesh.mesh_dim_names[0] == "dp_replicate", f"{what}: {p.device_mesh}"
        for t in (p, opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]):
            local = t.to_local().contiguous()
            pieces = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(pieces, local, group=group)
            assert torch.equal(pieces[0], pieces[1]), f"{what}: the replicas' pieces differ"


def _llama():
    torch.manual_seed(0)
    return tfm.LlamaForCausalLM(tfm.LlamaConfig(**LLAMA)).float()


def _pipeline(rank, world):
    batches = causal_batches(tfm.LlamaConfig(**LLAMA), STEPS)
    what = "pp=2 x 2 replicas"
    plugin, booster, model, opt = _train(_hsdp(pp=2), _llama, batches, _reference(_llama(), batches), what)
    for p in model.unwrap().parameters():
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard"), what
    _replicas_agree(model, opt, plugin, what)
    replicas = plugin.mesh.group("dp_replicate")
    with dispatched_comm_counter(plugin.mesh, names={replicas: "dp_replicate"}) as counter:
        _step(booster, plugin, model, opt, batches[0])
    ops = counter.summary()["dp_replicate"]["by_op"]
    units = sum(isinstance(m, FSDPModule) for m in model.unwrap().modules())
    if rank == 0:
        print(f"\n[{what}] {units} units here; replica collectives in one step of 2 micro-batches: {ops}")
    assert ops.get("all_reduce", 0) == units, f"{what}: {ops} for {units} units"
    opt.zero_grad()
    config = tfm.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=96, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)

    def gpt2():
        torch.manual_seed(0)
        return tfm.GPT2LMHeadModel(config).float()
    batches = causal_batches(config, STEPS)
    _train(_hsdp(pp=2, max_norm=0.05), gpt2, batches, _reference(gpt2(), batches, max_norm=0.05),
           "GPT-2 tied across stages, pp=2 x 2 replicas, clipped")


def _experts(rank, world):
    from meshboost.booster.plugin import MoeHybridParallelPlugin

    config = moe_config("qwen3_moe")
    batches = causal_batches(config, STEPS)
    make = lambda: build_causal_lm(config)              # noqa: E731
    ref = _reference(make(), batches, max_norm=0.05)
    what = "qwen3_moe ep=2 x 2 replicas, clipped"
    plugin, _, model, opt = _train(_hsdp(ep=2, max_norm=0.05), make, batches, ref, what)
    for n, p in model.unwrap().named_parameters():
        want = ("dp_replicate", "edp_shard") if ".experts." in n else ("dp_replicate", "edp_shard_ep")
        assert p.device_mesh.mesh_dim_names == want, f"{what}: {n} on {p.device_mesh.mesh_dim_names}"
    _replicas_agree(model, opt, plugin, what)
    plugin = MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2, zero_stage=3, dp_replicate_size=2,
                                     max_norm=0.05)
    assert plugin.moe_dp_size == 2 and plugin.mesh.dims.edp_shard == 1
    _train(None, make, batches, ref, "MoeHybridParallelPlugin(ep_size=2, zero_stage=3, dp_replicate_size=2)",
           plugin=plugin)


def _state(opt) -> dict:
    return {i: entry["per_element"] for i, entry in opt.state_dict()["state"].items()}


def _checkpoint(rank, world):
    """ep=2 HSDP saves; plain dp=4 (ep=1, ZeRO-1) loads the model and optimizer exactly and goes on."""
    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    folder = folder[0]
    config = moe_config("qwen3_moe")
    batches = causal_batches(config, STEPS)
    make = lambda: build_causal_lm(config)              # noqa: E731
    ref_losses, _, ref_weights, _ = _reference(make(), batches)
    plugin, booster, model, opt = _boost(_hsdp(ep=2), make())
    _step(booster, plugin, model, opt, batches[0])
    opt.step(), opt.zero_grad()
    saved = {n: _whole(p, p) for n, p in model.unwrap().named_parameters()}
    saved_state = _state(opt)
    booster.save_model(model, f"{folder}/model", shard=True, size_per_shard=0.01)
    booster.save_optimizer(opt, f"{folder}/optim", shard=True)
    plugin, booster, model, opt = _boost(HybridParallelConfig(zero=ZeroConfig(stage=1)), make())
    booster.load_model(model, f"{folder}/model")
    booster.load_optimizer(opt, f"{folder}/optim")
    for n, p in model.unwrap().named_parameters():
        master = opt.master_weight(p)
        assert torch.equal(p.detach(), saved[n]) and (master is None or torch.equal(master, saved[n])), n
    got = _state(opt)
    assert got.keys() == saved_state.keys()
    for i, entry in saved_state.items():
        for key, value in entry.items():
            assert torch.equal(got[i][key], value), f"load_optimizer {i} {key}"
    loss = _step(booster, plugin, model, opt, batches[1])
    assert abs(loss - ref_losses[1]) <= 2e-5 * abs(ref_losses[1]), f"resumed loss {loss} vs {ref_losses[1]}"
    opt.step()
    _check({n: p.detach() for n, p in model.unwrap().named_parameters()}, ref_weights, "resumed at dp=4")


def _body(rank, world):
    for part in (_pipeline, _experts, _checkpoint):
        start = time.perf_counter()
        part(rank, world)
        if rank == 0:
            print(f"[time] {part.__name__}: {time.perf_counter() - start:.1f} s", flush=True)


def test_hsdp_with_pipeline_and_experts():
    spawn(_body, 4)
