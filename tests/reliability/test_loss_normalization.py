"""Padding must not change the objective (issue 11): with loss_normalization="tokens" (the default) a
causal LM trained at tp=2 x dp=2 on batches whose replicas hold different numbers of real tokens
trains exactly what one process trains on the whole batch (the mean over every labelled token):
per-step losses (the dp mean of what each rank reports) within 1e-5, the first step's reduced gradients
(gathered) and global norm, and the weights after the steps,
with DDP and with ZeRO-1, and with gradient accumulation under no_sync when the script passes each
rank's `num_items_in_batch` for its accumulation window (as transformers' Trainer does). Pipeline
micro-batches are covered in tests/pipeline/test_pipeline.py. "microbatch" keeps the mean of the
replicas' means, which differs on these batches."""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.pipeline.normalization import count_items
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.compare import gathered, gradients_checked, train_reference
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS, STEPS = "LlamaForCausalLM", 3


def _batches(config):
    out = []
    for s in range(STEPS):
        b = tiny_batch(CLS, config, batch=8, seq=8, seed=20 + s)
        labels = b["input_ids"].clone()
        labels[:3, 2:] = -100                  # replica 0 (rows 0-3) holds far fewer real tokens
        labels[5, 5:] = -100
        out.append({"input_ids": b["input_ids"], "labels": labels})
    return out


def _train(config, batches, first=None, accumulate: int = 1, **plugin_kwargs):
    """Train at tp=2 x dp=2; `first`: one process's first-step gradients, which the first step's reduced
    gradients and global norm must equal."""
    plugin = HybridParallelPlugin(tp_size=2, **plugin_kwargs)
    model = build_model(CLS, copy.deepcopy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    booster = Booster(plugin=plugin)
    model, opt, *_ = booster.boost(model, opt)
    losses = []
    for b in batches:
        mine = {k: v.chunk(plugin.dp_size)[plugin.mesh.dp_rank] for k, v in b.items()}
        parts = [{k: v.chunk(accumulate)[i] for k, v in mine.items()} for i in range(accumulate)]
        window = sum(count_items(p["labels"], shifted=True) for p in parts)     # this rank's accumulation window
        reported = 0.0
        for i, part in enumerate(parts):
            extra = {"num_items_in_batch": window} if accumulate > 1 else {}
            with booster.no_sync(model, opt) if i < accumulate - 1 else contextlib.nullcontext():
                loss = model(**part, **extra).loss
                booster.backward(loss, opt)
            reported += loss.item()
        check = first is not None and not losses
        with gradients_checked(model, opt, first, f"{plugin_kwargs} accumulate={accumulate} step 0") if check \
                else contextlib.nullcontext():
            opt.step()
        opt.zero_grad()
        t = torch.tensor([reported])
        dist.all_reduce(t, group=plugin.mesh.dp_group)
        losses.append(t.item() / plugin.dp_size)
    return losses, model


def _body(rank, world):
    config = tiny_config("llama")
    batches = _batches(config)
    ref = build_model(CLS, copy.deepcopy(config))     # one process, the whole batch: mean over all real tokens
    reference = train_reference(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4), batches)
    ref_losses, first, ref_params = reference.losses, reference.first, dict(ref.named_parameters())
    for kwargs in (dict(zero_stage=0), dict(zero_stage=1), dict(zero_stage=1, accumulate=2),
                   dict(zero_stage=0, accumulate=2)):
        losses, model = _train(config, batches, first, **kwargs)
        for step, (got, want) in enumerate(zip(losses, ref_losses)):
            assert abs(got - want) <= 1e-5, f"{kwargs} step {step}: {got} vs whole-batch {want}"
        for name, p in model.unwrap().named_parameters():
            assert_close(gathered(p), ref_params[name].detach(), msg=f"{kwargs} weight {name}", scale=3)
    # The mean of the replicas' means trains another objective on these batches.
    losses, _ = _train(config, batches, zero_stage=1, loss_normalization="microbatch")
    assert abs(losses[0] - ref_losses[0]) > 1e-3, f"microbatch {losses[0]} vs whole batch {ref_losses[0]}"


def test_padding_does_not_change_the_objective():
    spawn(_body, 4)
