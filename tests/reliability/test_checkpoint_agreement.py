"""Training checkpoints that every rank agrees on, and models every rank built alike (issue 23,
points 1, 4, 6 and 7), in one process group of 4 ranks:

- `save_checkpoint` with a `step` (or `keep_last`) that differs by rank: ValueError on every rank
  naming each rank's value, before anything is written (no step committed, no staging left).
- ranks that built different models (2 vs 3 layers; another width): ValueError on every rank at
  `boost` naming the first differences, instead of gloo's "collective mismatch" abort.
- a step whose `ranks/rank-00001.pt` is missing (or truncated), or whose `optimizer/` is gone: the
  rank that lacks it raises naming the file, every other rank raises quoting it, nobody loads
  anything and nobody is left in a collective (a barrier afterwards completes).
- resuming at another layout: a tp=2 x dp=2 run saved mid-epoch resumes at tp=1 x dp=4 with the
  same global batch on exactly the samples the uninterrupted run trains next (the sample ids of
  every later step equal); where the saved position is not a multiple of the new data-parallel
  size, the warning names the samples trained again, and they are exactly those.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from meshboost import Booster
from meshboost.booster.plugin import HybridParallelPlugin
from meshboost.testing import spawn
from meshboost.testing.models import VOCAB, build_model, tiny_config

SAMPLES = 40


def _boosted(tp, batch_size, seed=0, **config):
    plugin = HybridParallelPlugin(tp_size=tp)
    booster = Booster(plugin=plugin)
    model = build_model("GPT2LMHeadModel", tiny_config("gpt2", **config), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(1, VOCAB, (SAMPLES, 8), generator=torch.Generator().manual_seed(3))
    data = TensorDataset(ids, torch.arange(SAMPLES))
    loader = plugin.prepare_dataloader(data, batch_size=batch_size, shuffle=True, seed=9)
    model, opt, *_ = booster.boost(model, opt)
    return booster, model, opt, loader


def _global_ids(index: torch.Tensor, plugin_dp_rank: int, tp_rank: int) -> list[int]:
    """The sample ids of this step over every data-parallel replica (tp rank 0 of each speaks)."""
    mine = index if tp_rank == 0 else index[:0]
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, mine.tolist())
    return sorted(i for s in sizes for i in s)


def _steps(booster, model, opt, loader, steps, train=True):
    """Run `steps` steps from the loader's position; the global sample ids of each step."""
    seen, it = [], iter(loader)
    for _ in range(steps):
        ids, index = next(it)
        if train:
            booster.backward(model(input_ids=ids, labels=ids).loss, opt)
            opt.step(), opt.zero_grad()
        mesh = booster.plugin.mesh
        seen.append(_global_ids(index, mesh.dp_rank, mesh.tp_rank))
    return seen


def _step_disagreement(rank, world, root):
    booster, model, opt, _ = _boosted(2, 2)
    folder = os.path.join(root, "steps")
    with pytest.raises(ValueError, match=r"step is 2 on rank 0, 3 on rank 1, 3 on rank 2, 3 on rank 3"):
        booster.save_checkpoint(folder, model, opt, step=2 if rank == 0 else 3)
    with pytest.raises(ValueError, match=r"keep_last is 3 on rank 0, 3 on rank 1, 3 on rank 2, 1 on rank 3"):
        booster.save_checkpoint(folder, model, opt, step=2, keep_last=1 if rank == 3 else 3)
    with pytest.raises(ValueError, match=r"step is -1 on rank 0, 4 on rank 1"):   # a bad value on one rank only
        booster.save_checkpoint(folder, model, opt, step=-1 if rank == 0 else 4)
    dist.barrier()
    assert not os.path.exists(folder) or os.listdir(folder) == [], "a refused save wrote something"
    assert booster.load_checkpoint(folder, model, opt) is None


def _different_models(rank, world):
    with pytest.raises(ValueError, match=r"ranks built different models.*parameter transformer\.h\.2\.\S+ is "
                                         r"\(absent\) on rank 0.*on rank 1"):
        _boosted(2, 2, n_layer=2 if rank == 0 else 3)
    with pytest.raises(ValueError, match=r"config\.n_embd is 32 on rank 0, 32 on rank 1, 32 on rank 2, 48 on rank 3"):
        _boosted(2, 2, n_embd=48 if rank == 3 else 32, n_head=4)
    _boosted(2, 2)                                      # the same model everywhere still boosts


def _missing_rank_files(rank, world, root):
    booster, model, opt, loader = _boosted(2, 2)
    folder = os.path.join(root, "missing")
    step = booster.save_checkpoint(folder, model, opt, dataloader=loader, step=1)
    rank_file = os.path.join(step, "ranks", "rank-00001.pt")
    dist.barrier()
    if rank == 0:
        os.rename(rank_file, rank_file + ".gone")
    dist.barrier()
    if rank == 1:
        with pytest.raises(FileNotFoundError, match=r"no state file for rank 1 .*rank-00001\.pt"):
            booster.load_checkpoint(folder, model, opt, dataloader=loader)
    else:
        with pytest.raises(RuntimeError, match=r"load_checkpoint.* failed on rank 1: FileNotFoundError.*rank-00001"):
            booster.load_checkpoint(folder, model, opt, dataloader=loader)
    dist.barrier()
    if rank == 0:                                      # a truncated rank file: named, on every rank
        with open(rank_file + ".gone", "rb") as src, open(rank_file, "wb") as dst:
            dst.write(src.read(10))
    dist.barrier()
    with pytest.raises(RuntimeError, match=r"rank 1's state file .*rank-00001\.pt"):
        booster.load_checkpoint(folder, model, opt, dataloader=loader)
    dist.barrier()
    if rank == 0:
        os.replace(rank_file + ".gone", rank_file)
        os.rename(os.path.join(step, "optimizer"), os.path.join(step, "optimizer.gone"))
    dist.barrier()
    with pytest.raises(FileNotFoundError, match=r"lists 'optimizer' but it is missing"):    # every rank sees it
        booster.load_checkpoint(folder, model, opt, dataloader=loader)
    booster.load_checkpoint(folder, model, dataloader=loader)     # without the optimizer the step still loads
    dist.barrier()                                                # nobody was left in a collective


def _another_layout(rank, world, root):
    folder = os.path.join(root, "layout")
    # tp=2 x dp=2, 2 samples per replica: 4 per step; the uninterrupted run gives the reference ids.
    booster, model, opt, loader = _boosted(2, 2)
    loader.sampler.set_epoch(1)
    reference = _steps(booster, model, opt, loader, 7)
    booster, model, opt, loader = _boosted(2, 2)
    loader.sampler.set_epoch(1)
    _steps(booster, model, opt, loader, 3)
    booster.save_checkpoint(folder, model, opt, dataloader=loader, step=3)

    # tp=1 x dp=4, 1 sample per replica: the same global batch; the next 4 steps are the reference's.
    booster, model, opt, loader = _boosted(1, 1)
    with pytest.warns(UserWarning, match=r"random generators are not.*data position is restored"):
        meta = booster.load_checkpoint(folder, model, opt, dataloader=loader)
    assert meta["step"] == 3 and loader.sampler.epoch == 1
    resumed = _steps(booster, model, opt, loader, 4)
    assert resumed == reference[3:], f"resumed at another layout on {resumed}, the run trains {reference[3:]}"

    # dp=2 with 1 sample per replica: 3 steps consume 6 samples; dp=4 resumes at sample 4 and says so.
    booster, model, opt, loader = _boosted(2, 1)
    loader.sampler.set_epoch(1)
    order = _steps(booster, model, opt, loader, 5, train=False)
    booster, model, opt, loader = _boosted(2, 1)
    loader.sampler.set_epoch(1)
    _steps(booster, model, opt, loader, 3, train=False)
    booster.save_checkpoint(folder, model, opt, dataloader=loader, step=4)
    booster, model, opt, loader = _boosted(1, 1)
    with pytest.warns(UserWarning, match=r"6 samples into epoch 1's order .* resumes at sample 4, so samples 4\.\.5"):
        booster.load_checkpoint(folder, model, opt, dataloader=loader)
    again = _steps(booster, model, opt, loader, 1, train=False)[0]
    flat = [i for step in order for i in step]         # the epoch's order as the dp=2 run consumed it
    by_position = _epoch_order(loader)
    assert sorted(by_position[:10]) == sorted(flat), "the permutation must not depend on the replica count"
    assert again == sorted(by_position[4:8]), f"resumed on {again}, expected positions 4..7 of the order"


def _epoch_order(loader) -> list[int]:
    """The epoch's permutation of the whole dataset, as DistributedSampler draws it."""
    g = torch.Generator()
    g.manual_seed(loader.sampler.seed + loader.sampler.epoch)
    return torch.randperm(SAMPLES, generator=g).tolist()


def _body(rank, world, root):
    _step_disagreement(rank, world, root)
    _different_models(rank, world)
    _missing_rank_files(rank, world, root)
    _another_layout(rank, world, root)


def test_checkpoints_and_models_agree_over_ranks(tmp_path):
    spawn(_body, 4, str(tmp_path))
