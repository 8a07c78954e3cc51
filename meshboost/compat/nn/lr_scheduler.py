"""ColossalAI's `nn.lr_scheduler`: its learning-rate schedules, on `torch.optim.lr_scheduler`.

Every class takes ColossalAI's arguments (`optimizer, total_steps, ...`; `total_steps` is accepted and
unused by the torch ones). Those torch has are torch's classes (CosineAnnealingLR, MultiStepLR,
OneCycleLR with max_lr = each group's lr, LambdaLR, MultiplicativeLR, StepLR, ExponentialLR). The
warmup, flat and polynomial ones are written in closed form, lr(t) at step t = `last_epoch` from each
group's base lr (their state_dict is torch's), with ColossalAI's numbers:

    warmup (W steps)      t < W:  base * (t + 1) / W                 (LinearWarmupLR: / (W + 1))
    cosine over T steps   eta_min + (base - eta_min) * (1 + cos(pi * s / T)) / 2,   s = steps since it began
    flat (F steps)        base
    polynomial over T     (base - end_lr) * (1 - min(s, T) / T) ** power + end_lr
    linear decay          base * (total - t) / (total - W), from t = W (not below 0: ColossalAI goes negative)

CosineAnnealingWarmupLR = warmup then cosine over total - W; FlatAnnealingLR = flat for
int(total * pct_start) then cosine; FlatAnnealingWarmupLR = warmup, flat for int((total - W) * pct_start),
cosine over the rest; MultiStepWarmupLR = warmup then base * gamma ** (milestones passed);
PolynomialWarmupLR = warmup then polynomial over total - W.
"""

from __future__ import annotations

import math
from bisect import bisect_right

from torch.optim import lr_scheduler as torch_schedulers

__all__ = ["CosineAnnealingLR", "CosineAnnealingWarmupLR", "FlatAnnealingLR", "FlatAnnealingWarmupLR",
           "LinearWarmupLR", "MultiStepLR", "MultiStepWarmupLR", "OneCycleLR", "PolynomialLR",
           "PolynomialWarmupLR", "LambdaLR", "MultiplicativeLR", "StepLR", "ExponentialLR"]


def _warmup(t: int, warmup_steps: int, base: float) -> float:
    return base * (t + 1) / warmup_steps


def _cosine(s: int, steps: int, base: float, eta_min: float) -> float:
    return eta_min + (base - eta_min) * (1 + math.cos(math.pi * s / steps)) / 2 if steps > 0 else base


def _check_fraction(pct_start: float) -> None:
    if not 0.0 <= pct_start <= 1.0:
        raise ValueError(f"pct_start={pct_start} must be in [0, 1]")


class _ClosedForm(torch_schedulers.LRScheduler):
    """A schedule given by `lr_at(t, base_lr)`: torch's scheduler machinery (stepping, state_dict,
    get_last_lr) with the rate computed from the step, never from the previous rate."""

    def lr_at(self, t: int, base: float) -> float:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return [self.lr_at(self.last_epoch, base) for base in self.base_lrs]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()


class CosineAnnealingWarmupLR(_ClosedForm):
    """Linear warmup over `warmup_steps`, then cosine annealing to `eta_min` at `total_steps`."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, eta_min: float = 0.0,
                 last_epoch: int = -1):
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, int(warmup_steps), eta_min
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base: float) -> float:
        if t < self.warmup_steps:
            return _warmup(t, self.warmup_steps, base)
        return _cosine(t - self.warmup_steps, self.total_steps - self.warmup_steps, base, self.eta_min)


class FlatAnnealingLR(_ClosedForm):
    """The base rate for the first `pct_start` of the steps, then cosine annealing to 0."""

    def __init__(self, optimizer, total_steps: int, pct_start: float = 0.72, last_epoch: int = -1, **kwargs):
        _check_fraction(pct_start)
        self.total_steps, self.flat_steps = total_steps, int(total_steps * pct_start)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base: float) -> float:
        if t < self.flat_steps:
            return base
        return _cosine(t - self.flat_steps, self.total_steps - self.flat_steps, base, 0.0)


class FlatAnnealingWarmupLR(_ClosedForm):
    """Linear warmup, the base rate for `pct_start` of the remaining steps, then cosine to `eta_min`."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, pct_start: float = 0.72,
                 eta_min: float = 0.0, last_epoch: int = -1, **kwargs):
        _check_fraction(pct_start)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        self.total_steps, self.warmup_steps, self.eta_min = total_steps, warmup_steps, eta_min
        self.flat_steps = int((total_steps - warmup_steps) * pct_start)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base: float) -> float:
        start = self.warmup_steps + self.flat_steps
        if t < self.warmup_steps:
            return _warmup(t, self.warmup_steps, base)
        if t < start:
            return base
        return _cosine(t - start, self.total_steps - start, base, self.eta_min)


class LinearWarmupLR(_ClosedForm):
    """Linear warmup to the base rate over `warmup_steps + 1` steps, then linear decay to 0 at `total_steps`."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, last_epoch: int = -1, **kwargs):
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base: float) -> float:
        if t < self.warmup_steps:
            return base * (t + 1) / (self.warmup_steps + 1)
        return base * max(self.total_steps - t, 0) / (self.total_steps - self.warmup_steps)


class MultiStepWarmupLR(_ClosedForm):
    """Linear warmup, then the base rate times `gamma` for every milestone (a step number) reached."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, milestones: list[int] | None = None,
                 gamma: float = 0.1, last_epoch: int = -1, **kwargs):
        if not milestones:
            raise ValueError("MultiStepWarmupLR needs milestones (the steps at which the rate is multiplied by gamma)")
        self.total_steps, self.warmup_steps, self.gamma = total_steps, int(warmup_steps), gamma
        self.milestones = sorted(m for m in milestones if m >= warmup_steps)
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base: float) -> float:
        if t < self.warmup_steps:
            return _warmup(t, self.warmup_steps, base)
        return base * self.gamma ** bisect_right(self.milestones, t)


class PolynomialLR(_ClosedForm):
    """Polynomial decay from the base rate to `end_lr` over `total_steps` (then `end_lr`)."""

    def __init__(self, optimizer, total_steps: int, end_lr: float = 0.0001, power: float = 1.0,
                 last_epoch: int = -1, **kwargs):
        if end_lr < 0:
            raise ValueError(f"end_lr={end_lr} must be >= 0")
        self.total_steps, self.end_lr, self.power = total_steps, end_lr, power
        super().__init__(optimizer, last_epoch)

    def lr_at(self, t: int, base: float) -> float:
        return (base - self.end_lr) * (1 - min(t, self.total_steps) / self.total_steps) ** self.power + self.end_lr


class PolynomialWarmupLR(PolynomialLR):
    """Linear warmup, then polynomial decay to `end_lr` over the remaining steps."""

    def __init__(self, optimizer, total_steps: int, warmup_steps: int = 0, end_lr: float = 0.0001,
                 power: float = 1.0, last_epoch: int = -1, **kwargs):
        self.warmup_steps = int(warmup_steps)
        super().__init__(optimizer, total_steps - self.warmup_steps, end_lr, power, last_epoch)

    def lr_at(self, t: int, base: float) -> float:
        if t < self.warmup_steps:
            return _warmup(t, self.warmup_steps, base)
        return super().lr_at(t - self.warmup_steps, base)


# -- torch's own schedules under ColossalAI's signatures ----------------------------------------------------
class CosineAnnealingLR(torch_schedulers.CosineAnnealingLR):
    """torch's cosine annealing with T_max = `total_steps`."""

    def __init__(self, optimizer, total_steps: int, eta_min: float = 0, last_epoch: int = -1, **kwargs):
        super().__init__(optimizer, total_steps, eta_min=eta_min, last_epoch=last_epoch)


class MultiStepLR(torch_schedulers.MultiStepLR):
    """torch's MultiStepLR (`total_steps` unused)."""

    def __init__(self, optimizer, total_steps: int, milestones: list[int] | None = None, gamma: float = 0.1,
                 last_epoch: int = -1, **kwargs):
        super().__init__(optimizer, milestones or [], gamma=gamma, last_epoch=last_epoch)


class OneCycleLR(torch_schedulers.OneCycleLR):
    """torch's 1cycle policy over `total_steps`, peaking at each group's current lr."""

    def __init__(self, optimizer, total_steps: int, pct_start: float = 0.3, anneal_strategy: str = "cos",
                 cycle_momentum: bool = True, base_momentum: float = 0.85, max_momentum: float = 0.95,
                 div_factor: float = 25.0, final_div_factor: float = 10000.0, last_epoch: int = -1, **kwargs):
        super().__init__(optimizer, [group["lr"] for group in optimizer.param_groups], total_steps=total_steps,
                         pct_start=pct_start, anneal_strategy=anneal_strategy, cycle_momentum=cycle_momentum,
                         base_momentum=base_momentum, max_momentum=max_momentum, div_factor=div_factor,
                         final_div_factor=final_div_factor, last_epoch=last_epoch, **kwargs)


class LambdaLR(torch_schedulers.LambdaLR):
    """torch's LambdaLR (`total_steps` unused)."""

    def __init__(self, optimizer, total_steps: int, lr_lambda=None, last_epoch: int = -1):
        super().__init__(optimizer, lr_lambda, last_epoch=last_epoch)


class MultiplicativeLR(torch_schedulers.MultiplicativeLR):
    """torch's MultiplicativeLR (`total_steps` unused)."""

    def __init__(self, optimizer, total_steps: int, lr_lambda=None, last_epoch: int = -1):
        super().__init__(optimizer, lr_lambda, last_epoch=last_epoch)


class StepLR(torch_schedulers.StepLR):
    """torch's StepLR (`total_steps` unused)."""

    def __init__(self, optimizer, total_steps: int, step_size: int = 1, gamma: float = 0.1, last_epoch: int = -1):
        super().__init__(optimizer, step_size, gamma=gamma, last_epoch=last_epoch)


class ExponentialLR(torch_schedulers.ExponentialLR):
    """torch's ExponentialLR (`total_steps` unused)."""

    def __init__(self, optimizer, total_steps: int, gamma: float = 1.0, last_epoch: int = -1):
        super().__init__(optimizer, gamma, last_epoch=last_epoch)
