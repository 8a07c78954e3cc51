"""Packed rows follow transformers' own rule at every layout (issue 56 item 1): rows of two documents
(`position_ids` restarting, no attention mask) on a tiny Qwen2, fp32, on 4 processes, each call against
the unsharded model making the same call from the same weights (loss, eval logits, every gradient).

transformers isolates the documents exactly when its forward holds no key/value cache: `use_cache` off
(the call's, else the config's), or turned off by gradient checkpointing in a training forward with
gradients enabled; otherwise they attend across each other. The cases: the config's use_cache on (every
causal LM's default) in training and in eval (across), use_cache=False passed (isolated), the config's off
(isolated), use_cache=True passed over a config that is off (across), gradient checkpointing on (isolated),
checkpointing on in a training-mode forward without gradients (across), a cache object passed (refused
under context parallelism: the split rows hold none). Each case first checks that the unsharded model
itself gives the rule's answer, and the batch is one where the two answers differ by far more than the
tolerance, so isolating always (main before this fix, by 4.8e-3) or never fails.

Layouts: cp=2 in both modes (all_to_all, ring_attn; x dp=2), tp=2 x cp=2, pp=2 x cp=2 (ring_attn), tp=2 and
pp=2 without cp (where the model's own forward decides), and tp=2 with regional compile (which turns the
cache off in training, but not for packed rows). At each one the notice is printed once, on rank 0 only,
when packed rows arrive with the cache on, and never for calls that isolate.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.pipeline import PipelineConfig
from meshboost.plugins import HybridParallelConfig, HybridParallelPlugin
from meshboost.shardformer import packed_rows
from meshboost.shardformer.compile import CompileConfig
from meshboost.testing import LOSS_ATOL, assert_close, spawn
from meshboost.testing.compare import gathered
from meshboost.testing.models import tiny_config
from meshboost.testing.moe import build_causal_lm

LAYOUTS = {
    "cp2 all_to_all": HybridParallelConfig(cp_size=2),
    "cp2 ring_attn": HybridParallelConfig(cp_size=2, cp_mode="ring_attn"),
    "tp2 cp2 all_to_all": HybridParallelConfig(tp_size=2, cp_size=2),
    "pp2 cp2 ring_attn": HybridParallelConfig(cp_size=2, cp_mode="ring_attn",
                                              pp_size=2, pipeline=PipelineConfig(num_microbatches=2)),
    "tp2": HybridParallelConfig(tp_size=2),
    "pp2": HybridParallelConfig(pp_size=2, pipeline=PipelineConfig(num_microbatches=2)),
    # regional compile turns the cache off in training for its graphs' sake, except for packed rows
    "tp2 compiled": HybridParallelConfig(tp_size=2, compile=CompileConfig(backend="aot_eager")),
}


@dataclass(frozen=True)
class Case:
    name: str
    config_cache: bool          # config.use_cache
    call: dict                  # what the call passes beyond the batch
    isolated: bool              # transformers' answer for this call
    training: bool = True
    checkpointing: bool = False
    grad: bool = True           # gradients enabled (and, in training, the loss backward)


# the isolating calls first: none of them may print the notice
CASES = (
    Case("use_cache=False passed", True, {"use_cache": False}, isolated=True),
    Case("config use_cache off", False, {}, isolated=True),
    Case("checkpointing on", True, {}, isolated=True, checkpointing=True),
    Case("eval, use_cache=False passed", True, {"use_cache": False}, isolated=True, training=False, grad=False),
    Case("config use_cache on", True, {}, isolated=False),
    Case("use_cache=True passed, config off", False, {"use_cache": True}, isolated=False),
    Case("eval, config use_cache on", True, {}, isolated=False, training=False, grad=False),
    Case("checkpointing on, no gradients", True, {}, isolated=False, checkpointing=True, grad=False),
)


def _batch() -> dict:
    ids = torch.randint(1, 100, (2, 16), generator=torch.Generator().manual_seed(3))
    return dict(input_ids=ids, labels=ids, position_ids=torch.tensor([list(range(6)) + list(range(10))] * 2))


class _Notices(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        if "packed rows" in record.getMessage():
            self.messages.append(record.getMessage())


def _set(model, case: Case) -> None:
    """The case's settings on an HF model: config.use_cache, train/eval, transformers' checkpointing."""
    model.config.use_cache = case.config_cache
    model.train(case.training)
    if case.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    elif model.is_gradient_checkpointing:
        model.gradient_checkpointing_disable()


def _reference(ref, case: Case, batch: dict) -> dict:
    _set(ref, case)
    ref.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(case.grad):
        out = ref(**batch, **case.call)
    if case.training and case.grad:
        out.loss.backward()
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    return dict(loss=out.loss.item(), logits=out.logits.detach(), grads=grads)


def _run(booster, model, optimizer, case: Case, batch: dict, pipelined: bool) -> dict | None:
    """The boosted call; None where it is not run (pipeline: no forward outside the schedule's modes)."""
    hf = model.unwrap()
    _set(hf, case)
    model.train(case.training)
    optimizer.zero_grad()
    if pipelined:
        if not case.grad and case.training:
            return None             # the schedule trains with gradients: no training-mode forward without them
        got = booster.execute_pipeline(iter([{**batch, **case.call}]), model, lambda out, inputs: out.loss,
                                       optimizer if case.training else None, return_loss=True,
                                       return_outputs=not case.training)
        out = got.get("outputs")
        return dict(loss=got.get("loss"), logits=None if out is None else out.logits)
    with torch.set_grad_enabled(case.grad):
        out = model(**batch, **case.call)
    if case.training and case.grad:
        out.loss.backward()
    return dict(loss=out.loss, logits=out.logits)


def _check(model, got: dict, want: dict, case: Case, what: str) -> None:
    if got["loss"] is not None:            # a pipeline's last stage holds it
        assert abs(got["loss"].item() - want["loss"]) < LOSS_ATOL[torch.float32], \
            f"{what}, {case.name}: loss {got['loss'].item()} against the unsharded {want['loss']}"
    if not case.training and got["logits"] is not None:
        assert_close(got["logits"], want["logits"], msg=f"{what}, {case.name}: eval logits")
    if case.training and case.grad:
        for n, p in model.unwrap().named_parameters():
            assert p.grad is not None, f"{what}, {case.name}: no gradient for {n}"
            assert_close(gathered(p, p.grad), want["grads"][n], msg=f"{what}, {case.name}: gradient of {n}")


def _layout(what: str, plugin_config, ref, batch: dict, wanted: dict, notices: _Notices) -> None:
    packed_rows._told.cache_clear()         # once per process: each layout starts untold
    model = copy.deepcopy(ref)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    booster = Booster(plugin=HybridParallelPlugin(copy.deepcopy(plugin_config)))
    model, optimizer, *_ = booster.boost(model, optimizer)
    pipelined = booster.plugin.pp_size > 1
    before = len(notices.messages)
    for case in CASES:
        got = _run(booster, model, optimizer, case, batch, pipelined)
        if got is not None:
            _check(model, got, wanted[case.name], case, what)
        told = len(notices.messages) - before
        # rank 0 only, from the first call with the cache on, and once
        expected = int(dist.get_rank() == 0 and not all(c.isolated for c in CASES[:CASES.index(case) + 1]))
        assert told == expected, f"{what}, after {case.name!r}: the notice printed {told} times on rank " \
                                 f"{dist.get_rank()}, expected {expected}"
    if booster.plugin.config.dims.cp > 1:    # a cache object would hold pieces of the sequences: refused
        from transformers import DynamicCache
        model.train()
        with pytest.raises(NotImplementedError, match="past_key_values was passed; the split rows hold no"):
            model(**batch, past_key_values=DynamicCache(config=model.unwrap().config))


def _body(rank, world):
    notices = _Notices()
    logging.getLogger("meshboost.shardformer").addHandler(notices)
    config = tiny_config("qwen2")
    assert config.use_cache, "every causal LM config's default"
    ref = build_causal_lm(config)
    batch = _batch()
    wanted = {case.name: _reference(ref, case, batch) for case in CASES}
    isolated, across = wanted["use_cache=False passed"]["loss"], wanted["config use_cache on"]["loss"]
    assert abs(isolated - across) > 1e-3, (isolated, across)      # the batch tells the two rules apart
    for case in CASES:                  # the table is transformers' own answer for each call
        assert abs(wanted[case.name]["loss"] - (isolated if case.isolated else across)) < 1e-6, case.name
    _set(ref, CASES[0])
    for what, plugin_config in LAYOUTS.items():
        _layout(what, plugin_config, ref, batch, wanted, notices)


def test_packed_rows_follow_transformers_at_every_layout():
    spawn(_body, 4)
