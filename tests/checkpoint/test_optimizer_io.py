"""Optimizer checkpoints are topology-free: an AdamW state saved at tp=2 x dp=2 with ZeRO-1 holds, per HF
parameter name, the full unpadded moments, `step` and fp32 masters equal to an unsharded single-process
reference's. Loaded (with the model and the LR scheduler) at tp=4, tp=1 x dp=4 (ZeRO-1), tp=2 x dp=2
(ZeRO-2), tp=2 x pp=2, LowLevelZeroPlugin (dp=4, ZeRO-1) and TorchDDPPlugin, training continues with the
reference's per-step losses (1e-5). A save at tp=2 x pp=2 (model + optimizer) is loaded by `from_pretrained`
in a plain process and matches the reference. fp16 masters and the loss-scaler state move between layouts
exactly; a crash during save leaves the previous checkpoint intact; an incomplete folder is refused clearly."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
from _train_helpers import CLS, assert_losses_close, batch, boosted, config, reference, train
from transformers import AutoModelForCausalLM

from meshboost.checkpoint import optimizer_io
from meshboost.checkpoint.optimizer_io import OptimizerCheckpoint
from meshboost.distributed.param_info import gather_tensor, get_tp_info
from meshboost.plugins import LowLevelZeroPlugin, TorchDDPPlugin
from meshboost.testing import assert_close, spawn
from meshboost.testing.models import build_model

LAYOUT_A = dict(tp_size=2, zero_stage=1)            # x dp=2 on 4 processes
RESHARD = [  # (layout, optimizer checkpoint to load)
    (dict(tp_size=4), "o10.bin"),
    (dict(tp_size=1, zero_stage=1), "o10"),
    (dict(tp_size=2, zero_stage=2), "o10"),
    (dict(tp_size=2, pp_size=2, num_microbatches=2), "o10"),
    (dict(plugin_cls=LowLevelZeroPlugin, stage=1, precision="fp32"), "o10"),
    (dict(plugin_cls=TorchDDPPlugin), "o10.bin"),
]


def check_entries(path, ref_state, msg, weights=None):
    """Saved entries vs the reference optimizer's state (by name): moments, step and masters."""
    ckpt = OptimizerCheckpoint(path)
    assert ckpt.resolve(["lm_head.weight"]) == "transformer.wte.weight", "tied head must find the embedding"
    assert ckpt.names() == set(ref_state), f"{msg}: names {sorted(ckpt.names() ^ set(ref_state))}"
    for name, ref in ref_state.items():
        e = ckpt.entry(name)
        assert set(e["per_element"]) == {"exp_avg", "exp_avg_sq"} and set(e["scalar"]) == {"step"}, name
        assert e["scalar"]["step"].item() == ref["step"].item(), f"{msg}: {name} step"
        for k in ("exp_avg", "exp_avg_sq"):
            assert_close(e["per_element"][k], ref[k], msg=f"{msg}: {name} {k}", scale=10)
        if "master" in e:
            assert_close(e["master"], ref["weight"], msg=f"{msg}: {name} master", scale=10)
            if weights is not None:       # fp32 ZeRO: the masters are exactly the model's weights
                assert torch.equal(e["master"], weights[name]), f"{msg}: {name} master vs model weight"
    return ckpt


def _body(rank, world, root):
    ref_losses, _, ref10 = reference(20, snapshot_at=10)
    booster, mesh, model, opt, sched = boosted(**LAYOUT_A)
    losses = train(booster, mesh, model, opt, sched, range(10))
    assert_losses_close(losses, ref_losses[:10], msg="tp=2 x dp=2 ZeRO-1 vs single process")
    inner = model.unwrap()
    assert get_tp_info(inner.transformer.wte.weight).padding > 0            # vocab padding exercised
    booster.save_model(model, os.path.join(root, "m10"), shard=True, use_safetensors=True)
    booster.save_optimizer(opt, os.path.join(root, "o10"), shard=True, size_per_shard=0.01)
    booster.save_optimizer(opt, os.path.join(root, "o10.bin"))
    booster.save_lr_scheduler(sched, os.path.join(root, "s10.pt"))
    index = json.load(open(os.path.join(root, "o10", optimizer_io.INDEX_NAME)))
    assert len(set(index["weight_map"].values())) > 2, "size_per_shard must split the state into several files"
    weights = {n: gather_tensor(p.detach(), get_tp_info(p)) for n, p in inner.named_parameters()}
    sharded = check_entries(os.path.join(root, "o10"), ref10, "sharded save", weights)
    single = check_entries(os.path.join(root, "o10.bin"), ref10, "single-file save")
    for name in sharded.names():
        assert all(torch.equal(sharded.entry(name)["per_element"][k], single.entry(name)["per_element"][k])
                   for k in ("exp_avg", "exp_avg_sq")), name
    groups = sharded.extra["param_groups"]
    assert len(groups) == 1 and groups[0]["lr"] == sched.get_last_lr()[0] and groups[0]["weight_decay"] == 0.01
    assert set(groups[0]["params"]) == set(ref10)

    # A crash while writing the second file: every rank raises, the previous checkpoint is untouched.
    target = os.path.join(root, "o10")
    before = {f: open(os.path.join(target, f), "rb").read() for f in os.listdir(target)}
    real, calls = optimizer_io._write_file, []

    def crashing(obj, path):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full (simulated)")
        real(obj, path)

    optimizer_io._write_file = crashing
    try:
        with pytest.raises(OSError if rank == 0 else RuntimeError):
            booster.save_optimizer(opt, target, shard=True, size_per_shard=0.01)
    finally:
        optimizer_io._write_file = real
    after = {f: open(os.path.join(target, f), "rb").read() for f in os.listdir(target)}
    assert after == before, "a failed save changed the existing checkpoint"
    assert not [f for f in os.listdir(root) if f.startswith(".")], "staging folder left behind"

    # Incomplete folders are refused, naming the problem.
    partial = os.path.join(root, "partial")
    if rank == 0:
        shutil.copytree(target, partial)
        os.remove(os.path.join(partial, sorted(set(index["weight_map"].values()))[0]))
    dist.barrier()
    with pytest.raises(RuntimeError, match="incomplete"):
        booster.load_optimizer(opt, partial)
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(partial, optimizer_io.INDEX_NAME))
    dist.barrier()
    with pytest.raises(RuntimeError, match="incomplete"):
        booster.load_optimizer(opt, partial)

    # The uninterrupted run continues.
    losses += train(booster, mesh, model, opt, sched, range(10, 20))
    assert_losses_close(losses[10:], ref_losses[10:], msg="uninterrupted tp=2 x dp=2 ZeRO-1")

    # Reshard: other layouts load model + optimizer + scheduler and continue like the reference.
    for layout, opt_ckpt in RESHARD:
        b2, mesh2, model2, opt2, sched2 = boosted(seed=7, **layout)          # other weights: the load must win
        b2.load_model(model2, os.path.join(root, "m10"))
        b2.load_optimizer(opt2, os.path.join(root, opt_ckpt))
        b2.load_lr_scheduler(sched2, os.path.join(root, "s10.pt"))
        got = train(b2, mesh2, model2, opt2, sched2, range(10, 20))
        assert_losses_close(got, ref_losses[10:], msg=f"resumed at {layout} from {opt_ckpt}")
        if mesh2.pp_size > 1:      # save the pipeline run; the main process checks it against the reference
            b2.save_model(model2, os.path.join(root, "m20pp"), shard=True, use_safetensors=True)
            b2.save_optimizer(opt2, os.path.join(root, "o20pp"), shard=True, size_per_shard=0.01)

    # fp16: fp32 masters and the loss-scaler state move between layouts exactly.
    fp32 = build_model(CLS, config(), seed=0).state_dict()
    b3, _, model3, opt3, _ = boosted(seed=0, precision="fp16", **LAYOUT_A)
    opt3.scaler.scale, opt3.scaler.growth_tracker = 1024.0, 5
    b3.save_optimizer(opt3, os.path.join(root, "o16"))
    # save_model under fp16 + ZeRO writes the fp32 masters, not the rounded half weights.
    b3.save_model(model3, os.path.join(root, "m16"), shard=True, use_safetensors=True)
    dist.barrier()
    from safetensors.torch import load_file
    folder = os.path.join(root, "m16")
    saved = {}
    for f in os.listdir(folder):
        if f.endswith(".safetensors"):
            saved.update(load_file(os.path.join(folder, f)))
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["dtype"] == "float32", "config.json must record the saved dtype"
    for name, t in saved.items():
        assert t.dtype == torch.float32 and torch.equal(t, fp32[name]), f"saved {name} is not the fp32 master"
    b4, _, model4, opt4, _ = boosted(seed=7, tp_size=4, precision="fp16")
    b4.load_optimizer(opt4, os.path.join(root, "o16"))
    assert (opt4.scaler.scale, opt4.scaler.growth_tracker) == (1024.0, 5)
    for name, p in model4.unwrap().named_parameters():
        full = gather_tensor(opt4.master_of[p].detach(), get_tp_info(p))
        assert torch.equal(full, fp32[name]), f"fp16 master {name} must be the exact fp32 weight"
        assert torch.equal(gather_tensor(p.detach(), get_tp_info(p)), fp32[name].half()), name


def test_optimizer_reshard(tmp_path):
    root = str(tmp_path)
    spawn(_body, 4, root)
    # The tp=2 x pp=2 saves, in a plain process: HF loads the model, the optimizer matches the reference.
    ref_losses, ref_model, ref20 = reference(20, snapshot_at=20)
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(root, "m20pp")).eval()
    ref_model.eval()
    with torch.no_grad():
        ids = batch(0)["input_ids"]
        assert_close(loaded(input_ids=ids).logits, ref_model(input_ids=ids).logits, msg="tp=2 x pp=2 save")
    check_entries(os.path.join(root, "o20pp"), ref20, "tp=2 x pp=2 save")


def test_no_plugin_single_process(tmp_path):
    """Booster() without a plugin (no process group): save after 3 steps, load into a fresh model, and the
    next 2 steps equal the uninterrupted run bitwise."""
    from _train_helpers import make_optimizer

    from meshboost import Booster

    def setup(seed):
        booster = Booster()
        model = build_model(CLS, config(), seed=seed)
        opt, sched = make_optimizer(model)
        model, opt, _, _, sched = booster.boost(model, opt, lr_scheduler=sched)
        return booster, model, opt, sched

    def steps(booster, model, opt, sched, which):
        out = []
        for s in which:
            loss = model(**batch(s)).loss
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            sched.step()
            out.append(loss.item())
        return out

    first = setup(0)
    steps(*first, range(3))
    first[0].save_model(first[1], str(tmp_path / "m"), shard=True)
    first[0].save_optimizer(first[2], str(tmp_path / "o"), shard=True, prefix="run1")
    first[0].save_lr_scheduler(first[3], str(tmp_path / "s.pt"))
    assert any(f.startswith("run1-optimizer-") for f in os.listdir(tmp_path / "o"))
    expected = steps(*first, range(3, 5))
    second = setup(7)
    second[0].load_model(second[1], str(tmp_path / "m"))
    second[0].load_optimizer(second[2], str(tmp_path / "o"))
    second[0].load_lr_scheduler(second[3], str(tmp_path / "s.pt"))
    assert steps(*second, range(3, 5)) == expected
