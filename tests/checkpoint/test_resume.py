"""Exact resume (issue 5 point 6): train 10 steps at tp=2 x dp=2 with ZeRO-1, save model + optimizer +
scheduler, train 10 more (the uninterrupted run). A FRESH process group (a second spawn) loads the
checkpoint and trains the same 10 steps: bitwise equal losses at the same layout, within 1e-5 at tp=1 x dp=4
(ZeRO-1); the uninterrupted run matches an unsharded single-process reference too. Also: an HF
`save_pretrained` folder loaded at tp=2 x dp=2 (ZeRO-1) through booster.load_model trains like the
reference (so the fp32 masters were refreshed), a model built on the meta device is boosted and then
loaded (tp=4 fp32, and ZeRO-1), and a meta model with DDP is refused clearly."""

import copy
import json
import os

import pytest
import torch
from transformers import GPT2LMHeadModel

from _train_helpers import CLS, assert_losses_close, boosted, config, reference, train
from meshboost.testing import spawn
from meshboost.testing.models import build_model

LAYOUT_A = dict(tp_size=2, zero_stage=1)      # x dp=2 on 4 processes


def _first_run(rank, world, root):
    booster, mesh, model, opt, sched = boosted(**LAYOUT_A)
    losses = train(booster, mesh, model, opt, sched, range(10))
    booster.save_model(model, os.path.join(root, "model"), shard=True, use_safetensors=True)
    booster.save_optimizer(opt, os.path.join(root, "optimizer"), shard=True)
    booster.save_lr_scheduler(sched, os.path.join(root, "scheduler.pt"))
    losses += train(booster, mesh, model, opt, sched, range(10, 20))
    if rank == 0:
        json.dump(losses, open(os.path.join(root, "losses.json"), "w"))


def _resumed(rank, world, root):
    uninterrupted = json.load(open(os.path.join(root, "losses.json")))
    for layout, exact in ((LAYOUT_A, True), (dict(tp_size=1, zero_stage=1), False)):
        booster, mesh, model, opt, sched = boosted(seed=7, **layout)
        booster.load_model(model, os.path.join(root, "model"))
        booster.load_optimizer(opt, os.path.join(root, "optimizer"))
        booster.load_lr_scheduler(sched, os.path.join(root, "scheduler.pt"))
        losses = train(booster, mesh, model, opt, sched, range(10, 20))
        if exact:
            assert losses == uninterrupted[10:], f"same layout must resume bitwise:\n{losses}\n{uninterrupted[10:]}"
        else:
            assert_losses_close(losses, uninterrupted[10:], msg=f"resumed at {layout}")

    # An HF folder (save_pretrained) loaded through booster.load_model; the next steps use the loaded
    # weights, so the ZeRO masters must have been refreshed from them.
    hf_losses = json.load(open(os.path.join(root, "hf_losses.json")))
    booster, mesh, model, opt, sched = boosted(seed=7, **LAYOUT_A)
    booster.load_model(model, os.path.join(root, "hf"))
    assert_losses_close(train(booster, mesh, model, opt, sched, range(3)), hf_losses, msg="HF folder at tp=2 ZeRO-1")

    # Meta-device models: boosted without memory for weights, materialised by load_model.
    for layout in (dict(tp_size=4), dict(tp_size=2, zero_stage=1)):
        with torch.device("meta"):
            meta = GPT2LMHeadModel(copy.deepcopy(config()))
        booster, mesh, model, opt, sched = boosted(model=meta, **layout)
        assert all(p.is_meta for p in model.parameters())
        booster.load_model(model, os.path.join(root, "hf"))
        assert not any(p.is_meta for p in model.parameters())
        assert_losses_close(train(booster, mesh, model, opt, sched, range(3)), hf_losses, msg=f"meta model {layout}")
    with torch.device("meta"):
        meta = GPT2LMHeadModel(copy.deepcopy(config()))
    with pytest.raises(ValueError, match="meta-device"):
        boosted(model=meta, tp_size=2)                     # dp=2 with DDP


def test_exact_resume_in_a_fresh_process_group(tmp_path):
    root = str(tmp_path)
    spawn(_first_run, 4, root)
    ref_losses, _, _ = reference(20)
    assert_losses_close(json.load(open(os.path.join(root, "losses.json"))), ref_losses,
                        msg="uninterrupted tp=2 x dp=2 ZeRO-1 vs single process")
    hf = build_model(CLS, copy.deepcopy(config()), seed=3)
    hf.save_pretrained(os.path.join(root, "hf"))
    json.dump(reference(3, model=hf)[0], open(os.path.join(root, "hf_losses.json"), "w"))
    spawn(_resumed, 4, root)
