"""A boosted model is freed when the user drops it (issue 37, point 2): for every plugin and layout,
boost, train one step, drop model, optimizer, booster and dataloader, three times in one process
(all at once; the booster last; the optimizer first), and check weak references to everything boosting made or touched: the user's model, each of its modules
and parameters, the boosted model and optimizer, the user's optimizer, its state tensors and fp32
masters, the booster, the plugin and the dataloader.

Freed at once (the moment the last reference goes, Python's cycle collector switched off): every
layout whose cycles would be meshboost's own, for it holds its owners by weak reference (ZeRO's
grad-ready hooks, the model/optimizer pairing, LoRA's adapters, expert parallelism's forward,
sequence parallelism's and activation checkpointing's hooks). Freed only at gc.collect(): the model of
the FSDP2 layouts (TorchFSDPPlugin, GeminiPlugin, zero_stage=3), whose modules torch's fully_shard
ties into cycles of its own hooks; their optimizer, states, booster, plugin and loader still go at
once. The booster-kept round also saves and loads a training checkpoint. Also: an optimizer dropped while its model is kept (an eval model) takes its states and masters
with it, and the model still trains; a booster kept across rounds (a sweep) keeps no model alive."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
import weakref

import torch

from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin as ColossalAIPlugin
from meshboost.booster.plugin.moe_hybrid_parallel_plugin import MoeHybridParallelPlugin
from meshboost.booster.plugin import GeminiPlugin, TorchFSDPPlugin
from meshboost.plugins import (HybridParallelConfig, HybridParallelPlugin, LowLevelZeroPlugin,
                               PipelineGradientCheckpointConfig, TorchDDPPlugin, ZeroConfig)
from meshboost.testing import spawn
from meshboost.testing.moe import build_causal_lm, causal_batches, moe_config
from meshboost.testing.models import tiny_config

CHECKPOINT_ALL = PipelineGradientCheckpointConfig(gradient_checkpointing_ratio=1.0)
CHECKPOINTS = None          # a training-checkpoint folder, the same on every rank (set in the body)

# name -> (plugin factory, tiny model family, LoRA adapters); world 2: each axis on its own
LAYOUTS = {
    "TorchDDPPlugin": (TorchDDPPlugin, "llama", False),
    "LowLevelZeroPlugin stage 1 fp16": (lambda: LowLevelZeroPlugin(stage=1), "llama", False),
    "LowLevelZeroPlugin stage 2 bf16": (lambda: LowLevelZeroPlugin(stage=2, precision="bf16"), "llama", False),
    "tp=2": (lambda: HybridParallelPlugin(tp_size=2), "llama", False),
    "ZeRO-1 bf16": (lambda: HybridParallelPlugin(zero_stage=1, precision="bf16"), "llama", False),
    "ZeRO-2 fp16": (lambda: HybridParallelPlugin(zero_stage=2, precision="fp16"), "llama", False),
    "pp=2, activation checkpointing": (
        lambda: ColossalAIPlugin(tp_size=1, pp_size=2, num_microbatches=2, gradient_checkpoint_config=CHECKPOINT_ALL),
        "llama", False),
    "tp=2 sequence parallel": (
        lambda: ColossalAIPlugin(tp_size=2, pp_size=1, enable_sequence_parallelism=True,
                                 sequence_parallelism_mode="split_gather"), "llama", False),
    "cp=2 ring attention": (lambda: HybridParallelPlugin(HybridParallelConfig(cp_size=2, cp_mode="ring_attn")),
                            "llama", False),
    "ep=2 ZeRO-1": (lambda: HybridParallelPlugin(HybridParallelConfig(ep_size=2, zero=ZeroConfig(stage=1))),
                    "moe", False),
    "MoeHybridParallelPlugin ep=2": (lambda: MoeHybridParallelPlugin(tp_size=1, pp_size=1, ep_size=2), "moe", False),
    "LoRA tp=2": (lambda: HybridParallelPlugin(tp_size=2), "llama", True),
    "ZeRO-3 (FSDP2)": (lambda: HybridParallelPlugin(zero_stage=3), "llama", False),
    "TorchFSDPPlugin": (TorchFSDPPlugin, "llama", False),
    "GeminiPlugin bf16": (lambda: GeminiPlugin(precision="bf16"), "llama", False),
}
# torch's fully_shard ties the model's modules into cycles of its own hooks (FSDPState, FSDPParam)
MODEL_FREED_AT_GC = {"ZeRO-3 (FSDP2)", "TorchFSDPPlugin", "GeminiPlugin bf16"}


def _criterion(outputs, batch):
    return outputs.loss


def _config(family: str):
    return moe_config("qwen3_moe") if family == "moe" else tiny_config(family)


def _boost_and_train(name: str):
    """Boost the layout's model and train it one step: (booster, model, optimizer, loader, refs), refs
    naming a weak reference to everything boosting made or touched."""
    make_plugin, family, lora = LAYOUTS[name]
    config = _config(family)
    batch = causal_batches(config, 1, batch=4, seq=8)[0]
    plugin = make_plugin()
    booster = Booster(plugin=plugin)
    user_model = build_causal_lm(config)
    model = user_model
    if lora:
        import peft
        model = booster.enable_lora(model, lora_config=peft.LoraConfig(r=4, lora_alpha=8,
                                                                       target_modules=["q_proj", "v_proj"]))
    user_optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loader = plugin.prepare_dataloader(list(batch["input_ids"]), batch_size=2)
    model, optimizer, criterion, loader, _ = booster.boost(model, user_optimizer, _criterion, dataloader=loader)
    _train_step(booster, model, optimizer, criterion, batch, plugin)
    refs = {"user model": user_model, "boosted model": model, "user optimizer": user_optimizer,
            "boosted optimizer": optimizer, "booster": booster, "plugin": plugin, "dataloader": loader}
    refs = {k: weakref.ref(v) for k, v in refs.items()}
    refs.update(_model_refs(model))
    refs.update(_optimizer_refs(model, user_optimizer))
    return booster, model, optimizer, loader, refs, batch


def _train_step(booster, model, optimizer, criterion, batch, plugin) -> None:
    if plugin.mesh.pp_size > 1:
        booster.execute_pipeline(iter([batch]), model, criterion, optimizer)
    else:
        booster.backward(model(**batch).loss, optimizer)
    _check_works_waited(model)
    optimizer.step()
    optimizer.zero_grad()


def _check_works_waited(model) -> None:
    """Every bucket all-reduce DDP's hook started is waited by the end of its backward: ProcessGroupNCCL
    keeps an async collective's tensors (the bucket, a copy of the gradients) until its work is waited,
    past the model's drop (gloo does not, so the waits are checked, not the bytes)."""
    for module in model.modules():
        state = getattr(module, "meshboost_allreduce", None)
        if isinstance(module, torch.nn.parallel.DistributedDataParallel) and state is not None:
            assert not state.pending and state.waited >= 1, (state.pending, state.waited)


def _model_refs(model) -> dict:
    inner = model.unwrap()
    out = {f"module {n or '(root)'}": weakref.ref(m) for n, m in inner.named_modules()}
    out.update({f"parameter {n}": weakref.ref(p) for n, p in inner.named_parameters()})
    return out


def _optimizer_refs(model, user_optimizer) -> dict:
    """The state tensors of `user_optimizer` (it steps the masters) and masters that are not the
    model's own parameters (fp32 copies, ZeRO's shards)."""
    params = {id(p) for p in model.unwrap().parameters()}
    out = {}
    for i, state in enumerate(user_optimizer.state.values()):
        out.update({f"optimizer state {i}.{k}": weakref.ref(v) for k, v in state.items()
                    if torch.is_tensor(v) and v.dim() > 0})
    for g, group in enumerate(user_optimizer.param_groups):
        out.update({f"master {g}.{i}": weakref.ref(p) for i, p in enumerate(group["params"]) if id(p) not in params})
    assert any(k.startswith("optimizer state") for k in out), "no optimizer state after a step"
    return out


def _alive(refs: dict) -> set[str]:
    return {k for k, r in refs.items() if r() is not None}


def _model_side(key: str) -> bool:
    return key in ("user model", "boosted model") or key.startswith(("module ", "parameter "))


def _check_dropped(name: str, refs: dict, what: str) -> None:
    """Everything is freed: at once, or (FSDP2's model only) at gc.collect()."""
    alive = _alive(refs)
    if name in MODEL_FREED_AT_GC:
        early = {k for k in alive if not _model_side(k) and not k.startswith("master")}
        assert not early, f"{name} {what}: alive without the model's torch cycles: {sorted(early)[:6]}"
        assert "user model" not in refs or "user model" in alive, (f"{name} {what}: the model was freed at once: torch's fully_shard no longer "
                                        "forms cycles; move this layout out of MODEL_FREED_AT_GC")
    else:
        assert not alive, f"{name} {what}: {len(alive)} objects outlive their last reference: {sorted(alive)[:6]}"
    gc.collect()
    alive = _alive(refs)
    assert not alive, f"{name} {what}: {len(alive)} objects survive gc.collect(): {sorted(alive)[:6]}"


def _checkpoint_round_trip(name: str, booster, model, optimizer, loader) -> None:
    """A training checkpoint saved and loaded back: the agreement, writer and loader keep nothing."""
    step = list(LAYOUTS).index(name) + 1
    booster.save_checkpoint(CHECKPOINTS, model, optimizer, dataloader=loader, step=step, keep_last=1)
    assert booster.load_checkpoint(CHECKPOINTS, model, optimizer, dataloader=loader) is not None


def _drop_all(name: str, keep_booster: bool) -> None:
    """Drop everything; with `keep_booster`, after a checkpoint round trip, the booster (and its
    plugin) last, as a sweep reusing one would: it holds no model."""
    booster, model, optimizer, loader, refs, _ = _boost_and_train(name)
    if keep_booster:
        _checkpoint_round_trip(name, booster, model, optimizer, loader)
    del model, optimizer, loader
    if keep_booster:
        kept = {k: refs.pop(k) for k in ("booster", "plugin")}
        _check_dropped(name, refs, "dropped, its booster kept")
        refs = kept
    del booster
    _check_dropped(name, refs, "dropped")


def _drop_optimizer_first(name: str) -> None:
    """An eval model: the optimizer dropped alone takes its states and masters with it; the model
    kept still runs forward and backward (ZeRO's hooks on its parameters went with the optimizer)."""
    booster, model, optimizer, loader, refs, batch = _boost_and_train(name)
    del optimizer
    optimizer_side = {k for k in refs if k.startswith(("optimizer state", "master")) or "optimizer" in k}
    assert not _alive({k: refs[k] for k in optimizer_side}), f"{name}: the optimizer outlives its last reference"
    if booster.plugin.mesh.pp_size == 1:
        model(**batch).loss.backward()
    del booster, model, loader
    _check_dropped(name, refs, "dropped after its optimizer")


def _body(rank, world):
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()         # "at once" means by reference counting alone
    global CHECKPOINTS
    CHECKPOINTS = os.path.join(tempfile.gettempdir(), f"meshboost_release_{os.environ['MASTER_PORT']}")
    # Build each family once outside the tracked frames: its transformers modules are imported on first
    # use (meshboost imports no family eagerly), and an import that keeps a caught exception keeps the
    # traceback's frames, the caller's locals included: that would be transformers' import, not a leak
    for family in sorted({family for _, family, _ in LAYOUTS.values()}):
        build_causal_lm(_config(family))
    try:
        for name in LAYOUTS:
            _drop_all(name, keep_booster=False)
            _drop_all(name, keep_booster=True)
            _drop_optimizer_first(name)
    finally:
        if collecting:
            gc.enable()
        if rank == 0:
            shutil.rmtree(CHECKPOINTS, ignore_errors=True)


def test_dropped_models_are_freed():
    spawn(_body, 2)
