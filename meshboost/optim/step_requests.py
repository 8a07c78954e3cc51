"""ColossalAI's OptimizerWrapper calls that scripts make around the step (`clip_grad_by_norm`,
`clip_grad_by_value`, `scale_loss`, `unscale_grad` before it, `get_grad_norm` after it), for the wrappers
whose gradients are final only inside `step()`: mixed precision, ZeRO and FSDP2.

Why requests: after `booster.backward` a gradient may still be loss-scaled (fp16), unreduced (ZeRO's
buckets flush at step; expert weights beside DDP average at step) or a shard of the whole (tp, ZeRO,
pp stages). Clipping it there, as ColossalAI's wrapper does with torch's `clip_grad_norm_` on the
local tensors, would use this rank's norm. So a call records what to do and `step()` applies it where
the gradients are final and unscaled: the norm is the global one (grad_norm.py: every rank agrees),
the value clamp is element-wise and so exact on any shard. A request lasts for the next `step()` only.

Owns: the requests and their checks. Must not touch gradients itself (the step does).
"""

from __future__ import annotations

import math
import warnings

import torch


class StepRequests:
    """Mixin of MixedPrecisionOptimizer: ColossalAI's clipping and scaling calls as requests to the next step."""

    _norm_request: tuple[float, float] | None = None     # (max_norm, norm_type) for the next step
    _value_request: float | None = None                  # |grad| bound for the next step
    _warned_untracked = False   # get_grad_norm() has said once that the norm is not computed

    def clip_grad_by_norm(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                          *args, **kwargs) -> None:
        """Clip the next step's gradients to a global norm of `max_norm` (ColossalAI's call between backward and
        step). Applied inside `step()` on the unscaled, reduced gradients of every rank; the norm before
        clipping is `get_grad_norm()` after the step. A plugin's own `max_norm` is replaced for that step.
        Returns None: the norm exists only once the step has reduced the gradients."""
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ValueError(f"clip_grad_by_norm(max_norm={max_norm!r}): a positive number is needed")
        if not (norm_type == math.inf or (isinstance(norm_type, (int, float)) and norm_type > 0)):
            raise ValueError(f"clip_grad_by_norm(norm_type={norm_type!r}): a positive number or math.inf")
        if error_if_nonfinite:
            raise NotImplementedError("clip_grad_by_norm(error_if_nonfinite=True): the norm is global and exists only "
                                      "inside step(); non-finite gradients there skip the step under fp16. Drop the "
                                      "argument and check get_grad_norm() after step()")
        self._norm_request = (float(max_norm), float(norm_type))

    def clip_grad_by_value(self, clip_value: float, *args, **kwargs) -> None:
        """Clamp every element of the next step's unscaled, reduced gradients to [-clip_value, clip_value]
        (torch's `clip_grad_value_`, applied inside `step()` after any norm clipping)."""
        if not isinstance(clip_value, (int, float)) or isinstance(clip_value, bool) or not clip_value > 0:
            raise ValueError(f"clip_grad_by_value(clip_value={clip_value!r}): a positive number is needed")
        self._value_request = float(clip_value)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the fp16 loss scale, for a script that calls `.backward()` on it itself (ColossalAI's
        call; `booster.backward(loss, optimizer)` does the same). Only with precision='fp16'."""
        if self.scaler is None:
            raise NotImplementedError(f"scale_loss: precision={self.precision!r} has no loss scale (only fp16 "
                                      "scales the loss); call booster.backward(loss, optimizer) or loss.backward()")
        self._scaled_backward = True
        return loss * self.loss_scale

    def unscale_grad(self) -> None:
        """ColossalAI's call before clipping under fp16. The step divides the gradients by the loss scale once,
        before any clipping, where they are reduced (ZeRO's partitions exist only there): the update a script
        gets is the one ColossalAI's unscale-then-clip gives, and the gradients are left as they are here."""
        if self.scaler is None:
            raise NotImplementedError(f"unscale_grad: precision={self.precision!r} has no loss scale (only fp16 "
                                      "scales the loss); drop the call")

    def get_grad_norm(self, norm_type: float = 2.0, **kwargs) -> float | None:
        """The unscaled global gradient norm of the last step; None before the first step, after a
        skipped (fp16 overflow) step, and after a step that did not compute it: the norm is computed
        only when clipping (max_norm > 0, or a clip_grad_by_norm request) or with track_grad_norm (a
        warning says so, once). norm_type: ColossalAI's argument, accepted; the norm is the step's own (of
        the clip's norm_type)."""
        if self._grad_norm is None and self._norm_untracked and not self._warned_untracked:
            self._warned_untracked = True
            warnings.warn("get_grad_norm() is None: without clipping (max_norm > 0) the step does not compute the "
                          "gradient norm (it costs a pass over the gradients and an all-reduce). Set "
                          "optimizer.track_grad_norm = True on every rank (or pass track_grad_norm=True) to "
                          "compute it on every step", stacklevel=2)
        return self._grad_norm

    def _take_norm_request(self) -> tuple[float, float]:
        """(max_norm, norm_type) for this step: a request of clip_grad_by_norm, else the config's."""
        request, self._norm_request = self._norm_request, None
        return request if request is not None else (self.max_norm, self.norm_type)

    @torch.no_grad()
    def _apply_value_request(self) -> None:
        """Clamp the gradients the inner optimizer is about to read (its param groups': the masters)."""
        bound, self._value_request = self._value_request, None
        if bound is not None:
            torch.nn.utils.clip_grad_value_(self.parameters(), bound)

    def _drop_requests(self) -> None:
        self._norm_request = self._value_request = None
