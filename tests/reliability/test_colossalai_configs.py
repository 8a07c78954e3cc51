"""The calls of ColossalAI's own tests (renamed to meshboost) that meshboost refused or broke (issue 56, item 7),
each run as ColossalAI runs it, in one 4-rank process group, against the unsharded single-process model of the
same seed (loss, and the weights after one SGD step: the gradients, compared without Adam's normalisation):

(a) sp_size beside sequence_parallelism_mode="split_gather" / "ring" (ColossalAI's qwen2 / qwen3 / command
    configs: tp=2 x pp=2, sp_size=2, flash attention, lazy init, ZeRO-1): sp_size follows tp_size, said once,
    on rank 0 only; the numbers are split_gather's; sp_size at tp_size 1 or with the mode unnamed is refused;
(b) "all_to_all" / "ring_attn" without sp_size (ColossalAI's command config, tp=4): a sequence group of one,
    the numbers of plain tensor parallelism; `shard_config.pipeline_stage_manager` is None at pp=1 and the
    plugin's stage manager at pp=2 (read in (a)), and a ShardFormer given one refuses;
(c) ShardFormer(ShardConfig()).optimize of a LazyInitContext model (ColossalAI's build_model /
    build_pipeline_model): no parameter left on meta, every shard the materialised original's, bit for bit;
(d) Linear1D_Col / Linear1D_Row (ColossalAI's test_linear_1d, lazy and not): state_dict() whole,
    load_state_dict of a whole tensor sliced back, output and gradients the nn.Linear's; keep_vars=True still
    gives the parameters (what meshboost's checkpoints read): a model sharded with them (a custom Policy) saves
    and loads the reference's weights;
(e) at pp=2: save_model(shard=False) to "<dir>/model.safetensors" and ".bin", with and without use_async (a
    folder that does not exist yet): one file holding the reference's weights; save_optimizer(shard=False): one
    file, which loads at tp=2 into Adam's reference state;
(f) a GeminiPlugin model's state_dict(only_rank_0=False, prefix="module.module.") and its optimizer's
    state_dict(only_rank_0=False) (ColossalAI's test_gemini_torch_compability): the reference model's and torch
    Adam's state dicts after the same step; only_rank_0=True leaves the other ranks empty; torch's state dict
    loads back;
(g) interleaved pipelines whose chunks hold no layer (ColossalAI's BERT 3d config: 2 layers over tp=2 x pp=2 x 2
    chunks, ZeRO-1; Llama with 1 layer; with sequence parallelism): the reference's loss and weights; a model
    whose stage cannot be empty (T5's carried position bias) is refused, saying why.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import transformers

from meshboost import Booster
from meshboost.booster.plugin import GeminiPlugin, HybridParallelPlugin
from meshboost.distributed.param_info import get_tp_info
from meshboost.lazy import LazyInitContext
from meshboost.shardformer import ShardConfig, ShardFormer
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import booster_step, gathered
from meshboost.testing.models import build_model, tiny_batch, tiny_config

LR = 0.5


def _built(cls: str, config, lazy: bool):
    """(reference, copy to boost): ColossalAI's build_model_from_hybrid_plugin, with or without lazy init."""
    if not lazy:
        ref = build_model(cls, copy.deepcopy(config))
        return ref, copy.deepcopy(ref)
    ctx = LazyInitContext()
    with ctx:
        ref = getattr(transformers, cls)(copy.deepcopy(config))
        model = copy.deepcopy(ref)
    ctx.materialize(ref)
    return ref, model


def _sgd_matches(what: str, make_plugin, cls: str, config, lazy: bool = False, batch_size: int = 4):
    """One SGD step boosted by `make_plugin()` equals one on the unsharded model: loss and every held weight."""
    ref, model = _built(cls, config, lazy)
    batch = tiny_batch(cls, config, batch=batch_size)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    torch.optim.SGD(ref.parameters(), lr=LR).step()
    plugin = make_plugin()
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=LR))
    loss = booster_step(booster, model, opt, batch)
    if loss is not None:
        assert abs(loss.item() - ref_loss.item()) <= LOSS_ATOL[torch.float32], f"{what}: {loss} vs {ref_loss}"
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for name, p in model.unwrap().named_parameters(remove_duplicate=False):
        assert_close(gathered(p), ref_params[name].detach(), msg=f"{what}: {name} after one SGD step")
    return plugin


class _Said(logging.Handler):
    def __init__(self, text: str):
        super().__init__()
        self.text, self.count = text, 0

    def emit(self, record):
        self.count += self.text in record.getMessage()


# -- (a), (b) sequence-parallel keywords, the stage manager view ----------------------------------------------------
def _check_sequence_keywords(rank: int) -> None:
    config = tiny_config("qwen2")
    for mode in ("split_gather", "ring"):
        said = _Said("sp_size=2 is ignored")
        logging.getLogger("meshboost.shardformer").addHandler(said)
        qwen2 = dict(tp_size=2, pp_size=2, sp_size=2, num_microbatches=2, enable_sequence_parallelism=True,
                     sequence_parallelism_mode=mode, enable_flash_attention=True, zero_stage=1)
        plugin = _sgd_matches(f"qwen2 {mode} sp_size=2", lambda: HybridParallelPlugin(**qwen2), "Qwen2ForCausalLM",
                              config, lazy=True)
        logging.getLogger("meshboost.shardformer").removeHandler(said)
        assert said.count == (1 if rank == 0 else 0), (mode, said.count)
        assert plugin.shard_config.sequence_parallel_size == 2 and plugin.sp_size == 1
        assert plugin.shard_config.pipeline_stage_manager is plugin.stage_manager is not None
    with pytest.raises(ValueError, match="sp_size=2 with sequence_parallelism_mode='ring' and tp_size=1"):
        HybridParallelPlugin(tp_size=1, sp_size=2, enable_sequence_parallelism=True, sequence_parallelism_mode="ring")
    with pytest.raises(ValueError, match="sequence_parallelism_mode=None: name the mode"):
        HybridParallelPlugin(tp_size=2, sp_size=2, enable_sequence_parallelism=True)
    llama = tiny_config("llama")
    for mode, tp in (("all_to_all", 4), ("ring_attn", 2)):
        command = dict(tp_size=tp, enable_sequence_parallelism=True, sequence_parallelism_mode=mode)
        plugin = _sgd_matches(f"{mode} without sp_size at tp={tp}", lambda: HybridParallelPlugin(**command),
                              "LlamaForCausalLM", llama)
        assert (plugin.sp_size, plugin.shard_config.sequence_parallel_size, plugin.mesh.dp_size) == (1, 1, 4 // tp)
        assert plugin.shard_config.pipeline_stage_manager is None
    with pytest.raises(NotImplementedError, match="never cuts pipeline stages"):
        ShardFormer(ShardConfig(pipeline_stage_manager=object())).optimize(build_model("LlamaForCausalLM", llama))


# -- (c) ShardFormer of a lazy model, (d) Linear1D state dicts ---------------------------------------------------
def _check_lazy_shardformer(rank: int) -> None:
    config = tiny_config("llama")
    org, model = _built("LlamaForCausalLM", config, lazy=True)
    sharded, _ = ShardFormer(ShardConfig()).optimize(model)                 # tp over the 4 ranks
    held = dict(sharded.named_parameters())
    assert not any(p.is_meta for p in held.values()) and any(get_tp_info(p) is not None for p in held.values())
    for name, p in org.named_parameters():
        assert torch.equal(gathered(held[name]), p.detach()), f"lazy ShardFormer: {name} is not the original's"
    batch = tiny_batch("LlamaForCausalLM", config)
    assert abs(sharded(**batch).loss.item() - org(**batch).loss.item()) <= LOSS_ATOL[torch.float32]


def _check_linear_1d(rank: int) -> None:
    from meshboost.shardformer.layer import Linear1D_Col, Linear1D_Row

    for lazy in (False, True):
        for cls, kwargs, dim in ((Linear1D_Col, dict(gather_output=True), 0), (Linear1D_Row, dict(parallel_input=False), 1)):
            torch.manual_seed(rank)                  # every rank's nn.Linear differs: only state dicts align them
            linear = nn.Linear(32, 128)
            with LazyInitContext() if lazy else contextlib.nullcontext():
                native = nn.Linear(32, 128)
            layer = cls.from_native_module(native, process_group=None, **kwargs)
            assert layer.weight is native.weight and not layer.weight.is_meta
            assert tuple(layer.weight.shape) == ((32, 32) if dim == 0 else (128, 8)), (cls, layer.weight.shape)
            whole = layer.state_dict()
            assert whole["weight"].shape == (128, 32) and whole["bias"].shape == (128,), (cls, lazy)
            linear.load_state_dict(whole)            # ColossalAI's test: reversibly loadable
            with torch.no_grad():
                linear.weight.add_(0.25)             # so that loading back must slice the new values
            layer.load_state_dict(linear.state_dict())
            assert torch.equal(layer.state_dict()["weight"], linear.weight.detach()), (cls, lazy)
            assert layer.state_dict(keep_vars=True)["weight"] is layer.weight       # meshboost's checkpoints
            x = torch.rand(2, 4, 32, generator=torch.Generator().manual_seed(7))
            x_ref, x_par = x.clone().requires_grad_(), x.clone().requires_grad_()
            out_ref, out = linear(x_ref), layer(x_par)
            assert_close(out, out_ref, msg=f"{cls.__name__} lazy={lazy} output")
            out_ref.sum().backward()
            out.sum().backward()
            assert_close(gathered(layer.weight, layer.weight.grad), linear.weight.grad, msg=f"{cls.__name__} grad")
            assert_close(x_par.grad, x_ref.grad, msg=f"{cls.__name__} input grad")


def _check_linear_1d_checkpoints(rank: int, tmp: str) -> None:
    """A model sharded with ColossalAI's layer names (a custom Policy) saves and loads as any sharded model."""
    from meshboost.shardformer import get_policy

    config = tiny_config("gpt2")
    ref = build_model("GPT2LMHeadModel", copy.deepcopy(config))
    base = get_policy(ref)
    names = {"colwise": "Linear1D_Col", "rowwise": "Linear1D_Row"}
    policy = type(base)(**{**base.__dict__, "name": "gpt2-linear1d",
                           "plan": {k: names.get(v, v) for k, v in base.plan.items()}})
    booster = Booster(plugin=HybridParallelPlugin(tp_size=2, custom_policy=policy))
    model, *_ = booster.boost(copy.deepcopy(ref))
    path = os.path.join(tmp, "linear1d")
    booster.save_model(model, path, shard=False)
    saved = transformers.GPT2LMHeadModel.from_pretrained(path)
    for name, p in ref.state_dict().items():
        assert torch.equal(saved.state_dict()[name], p), f"saved {name}"
    fresh, *_ = Booster(plugin=HybridParallelPlugin(tp_size=2, custom_policy=policy)).boost(
        build_model("GPT2LMHeadModel", copy.deepcopy(config)))
    booster.load_model(fresh, path)
    for name, p in fresh.unwrap().named_parameters():
        assert torch.equal(gathered(p), dict(ref.named_parameters())[name].detach()), f"loaded {name}"


# -- (e) one-file saves at pp=2 -----------------------------------------------------------------------------------
def _check_pipeline_single_files(rank: int, tmp: str) -> None:
    from safetensors.torch import load_file

    config = tiny_config("llama")
    ref = build_model("LlamaForCausalLM", copy.deepcopy(config))
    model = copy.deepcopy(ref)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=2, num_microbatches=2))
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    ref_state, seen = {}, set()                   # what a checkpoint holds: a tied tensor once, first name
    for key, value in ref.state_dict(keep_vars=True).items():
        if id(value) not in seen:
            seen.add(id(value))
            ref_state[key] = value.detach()
    for name in ("model.safetensors", "pytorch_model.bin"):
        for use_async in (False, True):
            path = os.path.join(tmp, f"new-{use_async}", name)
            booster.save_model(model, path, shard=False, use_async=use_async)
            saved = load_file(path) if name.endswith(".safetensors") else torch.load(path, weights_only=True)
            assert set(saved) == set(ref_state), f"{path}: {sorted(set(saved) ^ set(ref_state))[:4]}"
            for key, value in saved.items():
                assert torch.equal(value, ref_state[key]), f"{path}: {key}"
    batch = tiny_batch("LlamaForCausalLM", config)
    booster_step(booster, model, opt, batch)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    ref(**batch).loss.backward()
    ref_opt.step()
    path = os.path.join(tmp, "optimizer.bin")
    booster.save_optimizer(opt, path, shard=False)
    assert os.path.isfile(path)
    fresh = build_model("LlamaForCausalLM", copy.deepcopy(config))
    tp_booster = Booster(plugin=HybridParallelPlugin(tp_size=2))
    fresh, fresh_opt, *_ = tp_booster.boost(fresh, torch.optim.Adam(fresh.parameters(), lr=1e-3))
    tp_booster.load_optimizer(fresh_opt, path)
    held = dict(fresh.unwrap().named_parameters())
    for name, p in ref.named_parameters():
        state = fresh_opt.optim.state[fresh_opt.master_of[held[name]]]
        for key in ("exp_avg", "exp_avg_sq"):
            assert_close(gathered(held[name], state[key]), ref_opt.state[p][key], msg=f"{key} {name}")


# -- (f) Gemini's state dicts ---------------------------------------------------------------------------------------
def _check_gemini_state_dicts(rank: int) -> None:
    config = tiny_config("llama")
    ref = build_model("LlamaForCausalLM", copy.deepcopy(config))
    model = copy.deepcopy(ref)
    booster = Booster(plugin=GeminiPlugin(precision="fp32"))
    model, opt, *_ = booster.boost(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    batch = tiny_batch("LlamaForCausalLM", config)
    ref(**batch).loss.backward()
    ref_opt.step()
    booster.backward(model(**batch).loss, opt)
    opt.step()
    mine, expected = model.state_dict(only_rank_0=False, prefix="module.module."), ref.state_dict(prefix="module.module.")
    assert list(mine) == list(expected)
    for key, value in expected.items():
        assert_close(mine[key], value, msg=f"Gemini state_dict {key}")
    state, torch_state = opt.state_dict(only_rank_0=False), ref_opt.state_dict()
    assert set(state) == {"state", "param_groups"} and set(state["state"]) == set(torch_state["state"])
    assert state["param_groups"] == torch_state["param_groups"]
    for key, entry in torch_state["state"].items():
        assert set(state["state"][key]) == set(entry)
        for k, v in entry.items():
            assert_close(state["state"][key][k], v, msg=f"Gemini optimizer state {key} {k}")
    on_rank_0 = (model.state_dict(), opt.state_dict()["state"])
    assert all(bool(x) == (rank == 0) for x in on_rank_0), rank
    doubled = copy.deepcopy(torch_state)
    for entry in doubled["state"].values():
        entry["exp_avg_sq"] = entry["exp_avg_sq"] * 2
    opt.load_state_dict(doubled)                                       # torch's layout loads back
    again = opt.state_dict(only_rank_0=False)["state"]
    for key, entry in doubled["state"].items():
        assert_close(again[key]["exp_avg_sq"], entry["exp_avg_sq"], msg=f"loaded back {key}")


# -- (g) interleaved chunks without layers -------------------------------------------------------------------------
def _check_empty_chunks(rank: int) -> None:
    bert = tiny_config("bert")                                         # 2 layers over 4 chunks: [0, 1, 1, 0]
    colossalai_bert = dict(tp_size=2, pp_size=2, pp_style="interleaved", num_model_chunks=2, num_microbatches=4,
                           zero_stage=1)
    _sgd_matches("BERT 3d interleaved", lambda: HybridParallelPlugin(**colossalai_bert), "BertForMaskedLM", bert)
    llama = tiny_config("llama", num_hidden_layers=1)                  # [0, 0, 1, 0]
    for extra in ({}, dict(enable_sequence_parallelism=True, sequence_parallelism_mode="split_gather")):
        settings = dict(tp_size=2, pp_size=2, pp_style="interleaved", num_model_chunks=2, num_microbatches=2, **extra)
        _sgd_matches(f"llama 1 layer interleaved {extra}", lambda: HybridParallelPlugin(**settings),
                     "LlamaForCausalLM", llama)
    t5 = tiny_config("t5", num_layers=1, num_decoder_layers=1)
    booster = Booster(plugin=HybridParallelPlugin(tp_size=1, pp_size=4, num_microbatches=2))
    with pytest.raises(ValueError, match="a stage would hold no layer.*several stacks"):
        booster.boost(build_model("T5ForConditionalGeneration", t5))


def _body(rank: int, world: int, tmp: str) -> None:
    _check_sequence_keywords(rank)
    _check_lazy_shardformer(rank)
    _check_linear_1d(rank)
    _check_linear_1d_checkpoints(rank, tmp)
    _check_pipeline_single_files(rank, tmp)
    _check_gemini_state_dicts(rank)
    _check_empty_chunks(rank)


def test_colossalai_test_configurations_run_as_there(tmp_path):
    spawn(_body, 4, str(tmp_path))
