"""Loss scaling for fp16 training: a tiny object holding the scale and its counters.

Owns: the dynamic scale rule (grow after `growth_interval` clean steps, back off after
`hysteresis` overflows) and its `state_dict`. Must not communicate: whether a step overflowed is
decided by the optimizer wrapper over every rank of the step, and only the verdict comes here, so
all ranks update their scalers identically.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class GradScalerConfig:
    """Arguments of `DynamicGradScaler`, checked when built (defaults follow ColossalAI/Megatron)."""

    initial_scale: float = 2.0**16    # first loss multiplier
    min_scale: float = 1.0            # back-off never goes below this
    growth_factor: float = 2.0        # multiply by this after `growth_interval` clean steps
    backoff_factor: float = 0.5       # multiply by this once `hysteresis` overflows have been seen
    growth_interval: int = 1000       # clean steps between growths
    hysteresis: int = 2               # overflows tolerated before backing off
    max_scale: float = 2.0**32        # growth never goes above this
    max_skips_at_min_scale: int = 50  # overflows in a row at min_scale before training stops with an error

    def __post_init__(self):
        def positive(name):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"{name}={value!r} must be a positive number")
        for name in ("initial_scale", "min_scale", "max_scale"):
            positive(name)
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(f"need min_scale <= initial_scale <= max_scale, got {self.min_scale} <= "
                             f"{self.initial_scale} <= {self.max_scale}; adjust initial_scale or the bounds")
        if not (isinstance(self.growth_factor, (int, float)) and self.growth_factor > 1):
            raise ValueError(f"growth_factor={self.growth_factor!r} must be > 1 (e.g. 2)")
        if not (isinstance(self.backoff_factor, (int, float)) and 0 < self.backoff_factor < 1):
            raise ValueError(f"backoff_factor={self.backoff_factor!r} must be in (0, 1) (e.g. 0.5)")
        for name in ("growth_interval", "hysteresis", "max_skips_at_min_scale"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")


class DynamicGradScaler:
    """Dynamic loss scale with hysteresis.

    `update(found_inf)` after every step: an overflow resets the growth counter and uses up one
    unit of hysteresis; when none is left the scale is multiplied by `backoff_factor` (and keeps
    backing off on every further overflow until the next growth restores the hysteresis).
    `growth_interval` clean steps in a row multiply the scale by `growth_factor`.
    `max_skips_at_min_scale` overflows in a row with the scale already at `min_scale` raise
    FloatingPointError: no scale can help then (non-finite inputs, or a model fp16 cannot hold).
    """

    def __init__(self, config: GradScalerConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise TypeError("pass either a GradScalerConfig or keyword arguments, not both")
        self.config = config if config is not None else GradScalerConfig(**kwargs)
        self.scale = float(self.config.initial_scale)
        self.growth_tracker = 0                          # clean steps since the last overflow/growth
        self.hysteresis_tracker = self.config.hysteresis  # overflows left before backing off
        self.skips_at_min_scale = 0                      # overflows in a row with the scale at its floor

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scale

    def update(self, found_inf: bool) -> None:
        cfg = self.config
        if found_inf:
            at_floor = self.scale <= cfg.min_scale
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * cfg.backoff_factor, cfg.min_scale)
            self.skips_at_min_scale = self.skips_at_min_scale + 1 if at_floor else 0
            if self.skips_at_min_scale >= cfg.max_skips_at_min_scale:
                raise FloatingPointError(
                    f"fp16 training skipped {self.skips_at_min_scale} steps in a row at the minimum loss scale "
                    f"{cfg.min_scale} because gradients held inf/nan: the inputs or the loss are not finite (check the "
                    "batches for NaN/inf), or the model overflows fp16 even unscaled (train with precision='bf16' or "
                    "'fp32'). To keep skipping longer, raise max_skips_at_min_scale")
        else:
            self.skips_at_min_scale = 0
            self.growth_tracker += 1
            if self.growth_tracker == cfg.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = cfg.hysteresis
                self.scale = min(self.scale * cfg.growth_factor, cfg.max_scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker, "skips_at_min_scale": self.skips_at_min_scale,
                "config": asdict(self.config)}

    def load_state_dict(self, state: dict) -> None:
        missing = {"scale", "growth_tracker", "hysteresis_tracker"} - set(state)
        if missing:
            raise KeyError(f"loss-scaler state lacks {sorted(missing)}; was it saved by DynamicGradScaler?")
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
        self.skips_at_min_scale = int(state.get("skips_at_min_scale", 0))

    def __repr__(self) -> str:
        return (f"DynamicGradScaler(scale={self.scale}, growth_tracker={self.growth_tracker}, "
                f"hysteresis_tracker={self.hysteresis_tracker})")
