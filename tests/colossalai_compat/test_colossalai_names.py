"""The ColossalAI names meshboost.compat adds, by what they do: the LR schedules of `nn.lr_scheduler`
step by step against ColossalAI's formulas (and against torch's own schedules where torch composes
the same curve), `logging`'s logger writing only on the ranks asked for (2 processes),
`checkpoint_io`'s CheckpointIO / GeneralCheckpointIO round trip through the Booster's checkpoints,
`FP16TorchMixedPrecision`'s scaler settings reaching the boosted optimizer, `booster.accelerator`,
`interface.pretrained`. Everything but the logger runs in this process."""

import logging
import math
import os

import pytest
import torch
from torch.optim import lr_scheduler as torch_schedulers

from meshboost.booster import Booster
from meshboost.testing import spawn

TOTAL = 10


def _lrs(make, steps: int = TOTAL, lr: float = 1.0) -> list[float]:
    """The lr of the first group before each of `steps` optimizer steps."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = make(optimizer)
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def _cosine(s, steps, base=1.0, eta_min=0.0):
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * s / steps)) / 2


def test_warmup_and_flat_schedules_follow_colossalai_formulas():
    from meshboost.nn import lr_scheduler as S

    W = 3
    expected = [(t + 1) / W for t in range(W)] + [_cosine(t - W, TOTAL - W, eta_min=0.1) for t in range(W, TOTAL)]
    assert _lrs(lambda o: S.CosineAnnealingWarmupLR(o, TOTAL, warmup_steps=W, eta_min=0.1)) == pytest.approx(expected)
    # the same curve composed from torch's own schedules: LinearLR up to the base rate, then torch's cosine
    torch_made = _lrs(lambda o: torch_schedulers.SequentialLR(o, [
        torch_schedulers.LinearLR(o, start_factor=1 / W, end_factor=1.0, total_iters=W - 1),
        torch_schedulers.CosineAnnealingLR(o, TOTAL - W, eta_min=0.1)], milestones=[W]))
    assert torch_made == pytest.approx(expected)

    flat = int(TOTAL * 0.5)
    assert _lrs(lambda o: S.FlatAnnealingLR(o, TOTAL, pct_start=0.5)) == pytest.approx(
        [1.0] * flat + [_cosine(t - flat, TOTAL - flat) for t in range(flat, TOTAL)])
    flat = int((TOTAL - 2) * 0.5)
    assert _lrs(lambda o: S.FlatAnnealingWarmupLR(o, TOTAL, warmup_steps=2, pct_start=0.5, eta_min=0.1)) == \
        pytest.approx([0.5, 1.0] + [1.0] * flat + [_cosine(s, TOTAL - 2 - flat, eta_min=0.1)
                                                   for s in range(TOTAL - 2 - flat)])
    # LinearWarmupLR warms up over W + 1 steps (ColossalAI's), then falls linearly to 0 at TOTAL, and stays
    assert _lrs(lambda o: S.LinearWarmupLR(o, TOTAL, warmup_steps=W), steps=TOTAL + 2) == pytest.approx(
        [(t + 1) / (W + 1) for t in range(W)] + [(TOTAL - t) / (TOTAL - W) for t in range(W, TOTAL)] + [0.0, 0.0])
    # milestones inside the warmup are dropped; each one reached after it multiplies by gamma
    assert _lrs(lambda o: S.MultiStepWarmupLR(o, TOTAL, warmup_steps=2, milestones=[1, 4, 6], gamma=0.5)) == \
        pytest.approx([0.5, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25, 0.25, 0.25, 0.25])
    assert _lrs(lambda o: S.PolynomialWarmupLR(o, TOTAL, warmup_steps=2, end_lr=0.01, power=2.0),
                steps=TOTAL + 2) == pytest.approx(
        [0.5, 1.0] + [0.99 * (1 - min(s, TOTAL - 2) / (TOTAL - 2)) ** 2 + 0.01 for s in range(TOTAL)])
    assert _lrs(lambda o: S.PolynomialLR(o, TOTAL, end_lr=0.0, power=1.0)) == pytest.approx(
        [1 - t / TOTAL for t in range(TOTAL)])
    with pytest.raises(ValueError, match="pct_start=1.5"):
        _lrs(lambda o: S.FlatAnnealingLR(o, TOTAL, pct_start=1.5))
    with pytest.raises(ValueError, match="needs milestones"):
        _lrs(lambda o: S.MultiStepWarmupLR(o, TOTAL, milestones=[]))


def test_torch_schedules_take_colossalai_signatures():
    from meshboost.nn import lr_scheduler as S

    pairs = [(lambda o: S.CosineAnnealingLR(o, TOTAL, eta_min=0.1),
              lambda o: torch_schedulers.CosineAnnealingLR(o, TOTAL, eta_min=0.1)),
             (lambda o: S.MultiStepLR(o, TOTAL, milestones=[3, 6], gamma=0.5),
              lambda o: torch_schedulers.MultiStepLR(o, [3, 6], gamma=0.5)),
             (lambda o: S.OneCycleLR(o, TOTAL), lambda o: torch_schedulers.OneCycleLR(o, 1.0, total_steps=TOTAL)),
             (lambda o: S.StepLR(o, TOTAL, step_size=2, gamma=0.5), lambda o: torch_schedulers.StepLR(o, 2, 0.5)),
             (lambda o: S.ExponentialLR(o, TOTAL, gamma=0.9), lambda o: torch_schedulers.ExponentialLR(o, 0.9)),
             (lambda o: S.LambdaLR(o, TOTAL, lr_lambda=lambda t: 1 / (t + 1)),
              lambda o: torch_schedulers.LambdaLR(o, lambda t: 1 / (t + 1))),
             (lambda o: S.MultiplicativeLR(o, TOTAL, lr_lambda=lambda t: 0.9),
              lambda o: torch_schedulers.MultiplicativeLR(o, lambda t: 0.9))]
    for ours, torchs in pairs:
        assert _lrs(ours) == _lrs(torchs)


def test_a_schedule_resumes_from_its_state_dict():
    from meshboost.nn.lr_scheduler import CosineAnnealingWarmupLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = CosineAnnealingWarmupLR(optimizer, TOTAL, warmup_steps=3)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    resumed_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    resumed = CosineAnnealingWarmupLR(resumed_optimizer, TOTAL, warmup_steps=3)
    resumed.load_state_dict(scheduler.state_dict())
    for _ in range(3):
        scheduler.step()
        resumed.step()
        assert resumed.get_last_lr() == scheduler.get_last_lr()


def _log_on_ranks(rank, world, folder):
    from meshboost.logging import get_dist_logger

    logger = get_dist_logger("compat_test")
    logger.log_to_file(folder)
    logger.info("for everyone")
    logger.info("for rank 1", ranks=[1])
    logger.warning("for rank 0", ranks=[0])
    logger.set_level("WARNING")
    logger.info("below the level", ranks=[0, 1])
    assert get_dist_logger("compat_test").logger is logger.logger and logger.rank == rank


def test_logger_writes_only_on_the_ranks_asked_for(tmp_path):
    spawn(_log_on_ranks, 2, str(tmp_path))
    logs = {r: (tmp_path / f"rank_{r}.log").read_text() for r in (0, 1)}
    assert "for everyone" in logs[0] and "for everyone" in logs[1]
    assert "for rank 1" in logs[1] and "for rank 1" not in logs[0]
    assert "WARNING: for rank 0" in logs[0] and "for rank 0" not in logs[1]
    assert "below the level" not in logs[0] + logs[1]
    assert "test_colossalai_names.py" in logs[0]            # each message is preceded by its caller


def test_disable_existing_loggers_quiets_all_but_the_excluded():
    from meshboost.logging import disable_existing_loggers

    loud, kept = logging.getLogger("compat_test.loud"), logging.getLogger("compat_test.kept")
    loud.setLevel(logging.INFO)
    kept.setLevel(logging.INFO)
    disable_existing_loggers(include=["compat_test.loud"])
    assert loud.level == logging.WARNING and kept.level == logging.INFO


def _pair(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    booster = Booster()
    model, optimizer, *_ = booster.boost(model, torch.optim.AdamW(model.parameters(), lr=0.1))
    return booster, model, optimizer


def test_checkpoint_io_round_trip_through_the_booster(tmp_path):
    from meshboost.checkpoint_io import CheckpointIO, GeneralCheckpointIO
    from meshboost.nn.lr_scheduler import CosineAnnealingWarmupLR

    booster, model, optimizer = _pair(0)
    scheduler = CosineAnnealingWarmupLR(optimizer.unwrap(), TOTAL, warmup_steps=2)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    io = CheckpointIO(booster)
    io.save_model(model, str(tmp_path / "model.safetensors"))
    io.save_optimizer(optimizer, str(tmp_path / "optimizer.bin"))
    io.save_lr_scheduler(scheduler, str(tmp_path / "scheduler.bin"))

    booster2, model2, optimizer2 = _pair(1)
    scheduler2 = CosineAnnealingWarmupLR(optimizer2.unwrap(), TOTAL, warmup_steps=2)
    assert GeneralCheckpointIO().load_model(model2, str(tmp_path / "model.safetensors")) is model2
    CheckpointIO(booster2).load_optimizer(optimizer2, str(tmp_path / "optimizer.bin"))
    CheckpointIO(booster2).load_lr_scheduler(scheduler2, str(tmp_path / "scheduler.bin"))
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(optimizer.unwrap().state.values(), optimizer2.unwrap().state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))
    assert scheduler2.state_dict() == scheduler.state_dict()
    with pytest.raises(NotImplementedError, match="one writer saves every layout"):
        io.save_sharded_model(model, str(tmp_path / "x"))
    with pytest.raises(TypeError, match="needs a meshboost Booster"):
        CheckpointIO(object())


def test_fp16_torch_mixed_precision_reaches_the_boosted_optimizer():
    from meshboost.booster.mixed_precision import AMPOptimizer, FP16TorchMixedPrecision

    precision = FP16TorchMixedPrecision(init_scale=2.0**8, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    model = torch.nn.Linear(4, 2)
    _, optimizer, *_ = Booster(mixed_precision=precision).boost(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert isinstance(optimizer, AMPOptimizer)
    scaler = optimizer.scaler
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (2.0**8, 4.0, 0.25, 3)
    wrapped, _, criterion = precision.configure(torch.nn.Linear(4, 2), None, "loss")
    assert wrapped(torch.randn(2, 4)).dtype == torch.float16 and criterion == "loss"


def test_accelerator_interface_and_pretrained_path():
    from meshboost.booster.accelerator import Accelerator
    from meshboost.interface import ModelWrapper
    from meshboost.interface.pretrained import get_pretrained_path, set_pretrained_path

    model = Accelerator("cpu").configure_model(torch.nn.Linear(2, 2))
    assert model.weight.device.type == "cpu"
    with pytest.raises(ValueError, match="expected one of"):
        Accelerator("tpu")
    boosted, *_ = Booster().boost(torch.nn.Linear(2, 2))
    assert isinstance(boosted, ModelWrapper) and get_pretrained_path(boosted) is None
    set_pretrained_path(boosted, os.fspath("/models/x"))
    assert get_pretrained_path(boosted) == get_pretrained_path(boosted.unwrap()) == "/models/x"
