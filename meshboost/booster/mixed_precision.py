"""Booster-level automatic mixed precision (`Booster(mixed_precision="fp16" | "bf16")`) for plugins
that have no precision of their own (TorchDDPPlugin, or no plugin).

Owns: running the boosted model's forward under `torch.autocast` and, for fp16, loss scaling with
`torch.amp.GradScaler` (scale -> backward -> unscale -> skip the step on inf/nan and back off the
scale). Weights stay fp32; the plugin's parallelism is untouched. Under DDP every replica holds
the same averaged gradients, so every rank takes the same skip decision. Plugins with their own
`precision` (HybridParallelPlugin, LowLevelZeroPlugin) keep fp32 master weights themselves and
must not be combined with this.
"""

from __future__ import annotations

import torch

from meshboost.booster.wrappers import ModelWrapper
from meshboost.distributed import get_current_device
from meshboost.optim import PRECISION_DTYPES, OptimizerWrapper

AUTOCAST = ("fp16", "bf16")            # the precisions autocast runs in (dtypes: PRECISION_DTYPES)


def check_mixed_precision(mixed_precision, plugin) -> torch.dtype | None:
    """The autocast dtype for `mixed_precision` (a name, or an FP16TorchMixedPrecision), or None; raises
    (pure, every rank) on bad input."""
    if isinstance(mixed_precision, FP16TorchMixedPrecision):
        mixed_precision = mixed_precision.precision
    if mixed_precision is None or mixed_precision == "fp32":
        return None
    if mixed_precision not in AUTOCAST:
        raise ValueError(f"mixed_precision={mixed_precision!r}; expected one of {AUTOCAST} or None")
    if plugin is not None and plugin.precision is not None:
        raise ValueError(f"Booster(mixed_precision={mixed_precision!r}) cannot be combined with "
                         f"{type(plugin).__name__}, which has its own precision; pass "
                         f"{type(plugin).__name__}(precision={mixed_precision!r}) instead")
    return PRECISION_DTYPES[mixed_precision]


class AutocastModel(ModelWrapper):
    """Runs the boosted model's forward under `torch.autocast(dtype)` on its device type."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype, device_type: str):
        super().__init__(module)
        self.dtype, self.device_type = dtype, device_type

    def forward(self, *args, **kwargs):
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)

    def no_sync(self):
        return self.module.no_sync()


class AMPOptimizer(OptimizerWrapper):
    """Loss scaling around a boosted optimizer (fp16); bf16 needs none and passes through.

    backward: scale the loss. step: unscale (inf/nan -> skip, scale backs off), then update the
    scale. `skipped_steps` counts skipped updates.
    """

    def __init__(self, optimizer: OptimizerWrapper, dtype: torch.dtype, device_type: str,
                 init_scale: float = 2.0**16, growth_interval: int = 1000, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5):
        super().__init__(optimizer.unwrap() if isinstance(optimizer, OptimizerWrapper) else optimizer)
        self.inner = optimizer if isinstance(optimizer, OptimizerWrapper) else OptimizerWrapper(optimizer)
        self.scaler = torch.amp.GradScaler(device_type, init_scale=init_scale, growth_interval=growth_interval,
                                           growth_factor=growth_factor, backoff_factor=backoff_factor,
                                           enabled=dtype == torch.float16)
        self.skipped_steps = 0

    def backward(self, loss: torch.Tensor, *args, **kwargs):
        self.inner.backward(self.scaler.scale(loss), *args, **kwargs)

    _unscaled = False           # unscale_grad ran since the last step (torch's scaler refuses a second one)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the scale (ColossalAI's call, for a script that runs backward itself)."""
        return self.scaler.scale(loss)

    def unscale_grad(self) -> None:
        """Divide gradients by the scale now (e.g. before clipping); `step` will not do it again."""
        if not self._unscaled:
            self.scaler.unscale_(self.optim)
            self._unscaled = True

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                          *args, **kwargs) -> torch.Tensor:
        """Unscale first (as ColossalAI's torch-AMP optimizer does), then torch's clipping."""
        self.unscale_grad()
        return super().clip_grad_by_norm(max_norm, norm_type, error_if_nonfinite)

    def clip_grad_by_value(self, clip_value: float, *args, **kwargs) -> None:
        self.unscale_grad()
        super().clip_grad_by_value(clip_value)

    def step(self, *args, **kwargs):
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None
        result = self.scaler.step(self.optim, *args, **kwargs)
        self._unscaled = False
        self.scaler.update()
        if scale is not None and self.scaler.get_scale() < scale:
            self.skipped_steps += 1
        return result

    def zero_grad(self, set_to_none: bool = True):
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizer": self.optim.state_dict(), "grad_scaler": self.scaler.state_dict()}

    def load_state_dict(self, state_dict):
        self.optim.load_state_dict(state_dict["optimizer"])
        self.scaler.load_state_dict(state_dict["grad_scaler"])


def apply_mixed_precision(model, optimizer, dtype: torch.dtype, device_type: str, **scaler):
    """Wrap a boosted (model, optimizer) pair for autocast + loss scaling (`scaler`: AMPOptimizer's
    init_scale, growth_interval, growth_factor, backoff_factor)."""
    model = AutocastModel(model, dtype, device_type)
    if optimizer is not None:
        optimizer = AMPOptimizer(optimizer, dtype, device_type, **scaler)
    return model, optimizer


def scaler_settings(mixed_precision) -> dict:
    """The GradScaler settings `Booster(mixed_precision=...)` asks for (none for a precision name)."""
    return dict(mixed_precision.scaler) if isinstance(mixed_precision, FP16TorchMixedPrecision) else {}


class FP16TorchMixedPrecision:
    """ColossalAI's `booster.mixed_precision.FP16TorchMixedPrecision`: fp16 autocast with torch's
    GradScaler, as `Booster(mixed_precision="fp16")` but with ColossalAI's scaler settings (and its
    default growth_interval, 2000). `Booster(mixed_precision=FP16TorchMixedPrecision(...))` takes it;
    `configure(model, optimizer, criterion)` wraps a pair directly, on the current device."""

    precision = "fp16"

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scaler = dict(init_scale=init_scale, growth_factor=growth_factor, backoff_factor=backoff_factor,
                           growth_interval=growth_interval)

    def configure(self, model, optimizer=None, criterion=None) -> tuple:
        model, optimizer = apply_mixed_precision(model, optimizer, PRECISION_DTYPES["fp16"], get_current_device().type,
                                                 **self.scaler)
        return model, optimizer, criterion
