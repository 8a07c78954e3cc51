"""booster.save_checkpoint / load_checkpoint: one step folder per save (model, optimizer, LR
scheduler, every rank's RNG states, the data loader's position), committed by an atomic `latest`
pointer, the last `keep_last` kept. A fresh process group that loads the folder continues mid-epoch
with per-step losses and random draws bitwise equal to the uninterrupted run (tp=2 x dp=2, ZeRO-1,
fp32, GPT-2 with its tied head); a save that crashes leaves `latest` on the previous complete step
and no staging folder behind; an empty folder loads as None (a fresh run)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from meshboost import Booster
from meshboost.checkpoint import optimizer_io
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing import spawn
from meshboost.testing.models import VOCAB, build_model, tiny_config

SAVE_EVERY, KEEP_LAST, STEPS = 3, 2, 14       # 40 samples / (dp 2 x batch 2) = 10 steps per epoch


def _setup(seed=0):
    plugin = HybridParallelPlugin(tp_size=2, zero_stage=1)
    booster = Booster(plugin=plugin)
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2"), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
    ids = torch.randint(1, VOCAB, (40, 8), generator=torch.Generator().manual_seed(11))
    loader = plugin.prepare_dataloader(TensorDataset(ids), batch_size=2, shuffle=True, seed=5)
    model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
    return booster, model, opt, sched, loader


def _train(booster, model, opt, sched, loader, root, step, until, save=True):
    """Train from `step` to `until`, saving every SAVE_EVERY steps; returns {step: (loss, draw)}."""
    record, epoch = {}, loader.sampler.epoch
    while step < until:
        loader.sampler.set_epoch(epoch)
        for (ids,) in loader:
            loss = model(input_ids=ids, labels=ids).loss
            booster.backward(loss, opt)
            opt.step(), opt.zero_grad(), sched.step()
            step += 1
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            record[step] = (mean.item() / dist.get_world_size(), torch.rand(1).item())   # the draw tests the RNG
            if save and step % SAVE_EVERY == 0:
                booster.save_checkpoint(root, model, opt, sched, loader, step=step, keep_last=KEEP_LAST,
                                        extra={"epoch": epoch})
            if step == until:
                break
        else:
            epoch += 1
    return record


def _first_run(rank, world, root):
    booster, model, opt, sched, loader = _setup()
    assert booster.load_checkpoint(root, model, opt, sched, loader) is None, "an empty folder is a fresh run"
    record = _train(booster, model, opt, sched, loader, root, 0, STEPS)
    # A save that crashes midway: every rank raises, `latest` stays on the last complete step.
    real, calls = optimizer_io._write_file, []

    def crashing(obj, path):
        calls.append(path)
        raise OSError("disk full (simulated)")

    optimizer_io._write_file = crashing
    try:
        with pytest.raises(OSError if rank == 0 else RuntimeError, match="disk full"):
            booster.save_checkpoint(root, model, opt, sched, loader, step=STEPS)
    finally:
        optimizer_io._write_file = real
    json.dump({str(k): v for k, v in record.items()}, open(_record_path(root, rank), "w"))


def _record_path(root, rank):
    return os.path.join(os.path.dirname(root), f"record-{rank}.json")      # each rank's own random stream


def _resumed(rank, world, root):
    booster, model, opt, sched, loader = _setup(seed=7)        # other weights and data state: the load must win
    meta = booster.load_checkpoint(root, model, opt, sched, loader)
    last = STEPS - STEPS % SAVE_EVERY
    assert meta["step"] == last and meta["extra"] == {"epoch": 1}, meta
    assert loader.sampler.epoch == 1 and loader.batches_done == last - 10, "mid-epoch position not restored"
    record = _train(booster, model, opt, sched, loader, root, meta["step"], STEPS, save=False)
    expected = json.load(open(_record_path(root, rank)))
    for step, got in record.items():
        assert list(got) == expected[str(step)], f"step {step}: resumed {got} vs uninterrupted {expected[str(step)]}"


def test_save_and_load_checkpoint_resume_exactly(tmp_path):
    root = str(tmp_path / "run")
    spawn(_first_run, 4, root)
    entries = sorted(os.listdir(root))
    kept = [f"step-{s:08d}" for s in range(SAVE_EVERY, STEPS + 1, SAVE_EVERY)][-KEEP_LAST:]
    assert entries == ["latest", *kept], entries
    assert open(os.path.join(root, "latest")).read().strip() == kept[-1]
    step = os.path.join(root, kept[-1])
    assert sorted(os.listdir(step)) == ["lr_scheduler.pt", "meta.json", "model", "optimizer", "ranks"]
    assert sorted(os.listdir(os.path.join(step, "ranks"))) == [f"rank-{r:05d}.pt" for r in range(4)]
    spawn(_resumed, 4, root)


def test_leftovers_of_a_dead_save(tmp_path):
    """A save killed between moving the old checkpoint aside and renaming the new one in (where the
    file system cannot exchange folders atomically) left `.ckpt.old-*/ckpt` and no `ckpt`; another
    left its staging folder. The next save to that path puts the old checkpoint back first and
    removes the leftovers; replacing an existing folder swaps it in one step."""
    from meshboost.checkpoint.atomic import AtomicTarget

    aside = tmp_path / ".ckpt.old-dead" / "ckpt"
    aside.mkdir(parents=True)
    (aside / "weights").write_text("step 5")
    (tmp_path / ".ckpt.tmp-dead").mkdir()
    target = AtomicTarget(str(tmp_path / "ckpt"), is_file=False)
    assert (tmp_path / "ckpt" / "weights").read_text() == "step 5", "the old checkpoint must come back"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ckpt.lock", os.path.basename(target.staging), "ckpt"]
    (tmp_path / target.staging / "weights").write_text("step 10")
    target.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert (tmp_path / "ckpt" / "weights").read_text() == "step 10"
