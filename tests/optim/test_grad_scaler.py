"""DynamicGradScaler without a process group: growth, backoff, hysteresis, min/max clamps,
state_dict round trip and argument validation."""

import pytest

from meshboost.optim import DynamicGradScaler, GradScalerConfig


def test_defaults_follow_the_issue():
    cfg = GradScalerConfig()
    assert (cfg.initial_scale, cfg.min_scale, cfg.growth_factor, cfg.backoff_factor, cfg.growth_interval,
            cfg.hysteresis, cfg.max_scale) == (2**16, 1, 2, 0.5, 1000, 2, 2**32)
    assert DynamicGradScaler().scale == 2**16


def test_growth_after_interval_clean_steps():
    s = DynamicGradScaler(initial_scale=8, growth_interval=3)
    for expected in (8, 8, 16, 16, 16, 32):
        s.update(found_inf=False)
        assert s.scale == expected
    # an overflow resets the growth counter
    s.update(False), s.update(False), s.update(True)
    s.update(False), s.update(False)
    assert s.scale == 32 and s.growth_tracker == 2


def test_backoff_with_hysteresis():
    s = DynamicGradScaler(initial_scale=64, hysteresis=2, growth_interval=2)
    s.update(True)
    assert s.scale == 64 and s.hysteresis_tracker == 1          # first overflow absorbed
    s.update(True)
    assert s.scale == 32                                        # second backs off
    s.update(True)
    assert s.scale == 16                                        # keeps backing off until a growth
    s.update(False), s.update(False)
    assert s.scale == 32 and s.hysteresis_tracker == 2          # growth restores the hysteresis
    s.update(True)
    assert s.scale == 32
    one = DynamicGradScaler(initial_scale=64, hysteresis=1)
    one.update(True)
    assert one.scale == 32


def test_min_and_max_clamp():
    s = DynamicGradScaler(initial_scale=4, min_scale=2, hysteresis=1, backoff_factor=0.25)
    s.update(True)
    assert s.scale == 2
    s.update(True)
    assert s.scale == 2
    g = DynamicGradScaler(initial_scale=4, max_scale=6, growth_interval=1, growth_factor=4)
    g.update(False)
    assert g.scale == 6
    g.update(False)
    assert g.scale == 6


def test_state_dict_round_trip():
    s = DynamicGradScaler(initial_scale=1024, growth_interval=5)
    s.update(True), s.update(False), s.update(False)
    state = s.state_dict()
    t = DynamicGradScaler(initial_scale=1024, growth_interval=5)
    t.load_state_dict(state)
    assert (t.scale, t.growth_tracker, t.hysteresis_tracker) == (s.scale, 2, 1)
    for _ in range(3):
        s.update(False), t.update(False)
    assert t.scale == s.scale == 2048
    with pytest.raises(KeyError, match="growth_tracker"):
        t.load_state_dict({"scale": 1.0})


@pytest.mark.parametrize("kwargs, match", [
    ({"initial_scale": 0}, "initial_scale=0"),
    ({"growth_factor": 1}, "growth_factor=1"),
    ({"backoff_factor": 1.0}, "backoff_factor=1.0"),
    ({"growth_interval": 0}, "growth_interval=0"),
    ({"hysteresis": 1.5}, "hysteresis=1.5"),
    ({"initial_scale": 2**40}, "min_scale <= initial_scale <= max_scale"),
    ({"min_scale": 8, "initial_scale": 4}, "min_scale <= initial_scale"),
])
def test_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GradScalerConfig(**kwargs)
