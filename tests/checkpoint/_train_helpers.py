"""Shared by the optimizer-checkpoint and resume tests: a tiny GPT-2 LM (vocab 101, padded at every
tp, tied LM head) trained with AdamW + StepLR on fixed per-step batches, either in one plain process
(the reference) or boosted at a given layout. Every step's loss is the global-batch mean, so runs at
different layouts are comparable."""

import copy

import torch
import torch.distributed as dist

from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing.compare import booster_step
from meshboost.testing.models import build_model, tiny_batch, tiny_config

CLS = "GPT2LMHeadModel"
GLOBAL_BATCH = 4


def config():
    return tiny_config("gpt2")


def batch(step: int) -> dict:
    ids = tiny_batch(CLS, config(), batch=GLOBAL_BATCH, seq=8, seed=100 + step)["input_ids"]
    return {"input_ids": ids, "labels": ids.clone()}   # no masked labels: per-rank means average exactly


def make_optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)


def reference(steps: int, seed: int = 0, model=None, snapshot_at: int | None = None):
    """Plain single-process run: (losses, model, optimizer state by name at `snapshot_at`)."""
    model = model if model is not None else build_model(CLS, copy.deepcopy(config()), seed=seed)
    opt, sched = make_optimizer(model)
    names = {id(p): n for n, p in model.named_parameters()}
    losses, snap = [], None
    for s in range(steps):
        if s == snapshot_at:
            snap = state_by_name(opt, names, model)
        loss = model(**batch(s)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    if snapshot_at == steps:
        snap = state_by_name(opt, names, model)
    return losses, model, snap


def state_by_name(opt, names, model) -> dict:
    out = {}
    for p, st in opt.state.items():
        out[names[id(p)]] = {k: v.detach().clone() for k, v in st.items()}
        out[names[id(p)]]["weight"] = p.detach().clone()
    return out


def boosted(seed: int = 0, model=None, plugin_cls=HybridParallelPlugin, **plugin_kwargs):
    """(booster, mesh, model, optimizer, scheduler) boosted by `plugin_cls(**plugin_kwargs)`."""
    plugin = plugin_cls(**plugin_kwargs)
    booster = Booster(plugin=plugin)
    model = model if model is not None else build_model(CLS, copy.deepcopy(config()), seed=seed)
    opt, sched = make_optimizer(model)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, plugin.mesh, model, opt, sched


def train(booster, mesh, model, opt, sched, steps) -> list[float]:
    """Global-batch losses (mean over dp, identical on every rank)."""
    n = GLOBAL_BATCH // mesh.dp_size
    losses = []
    for s in steps:
        local = {k: v[mesh.dp_rank * n:(mesh.dp_rank + 1) * n] for k, v in batch(s).items()}
        loss = booster_step(booster, model, opt, local)
        opt.zero_grad()
        sched.step()
        t = torch.tensor([loss.item()], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(t.item() / dist.get_world_size())
    return losses


def assert_losses_close(got, expected, atol=1e-5, msg=""):
    assert len(got) == len(expected), msg
    worst = max(abs(a - b) for a, b in zip(got, expected))
    assert worst <= atol, f"{msg}: max |loss diff| {worst:.3g} > {atol}\n got {got}\n exp {expected}"
