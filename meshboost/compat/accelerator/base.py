"""BaseAccelerator: ColossalAI's accelerator interface, answered for the device this process
computes on (`meshboost.distributed.get_current_device`, read from the environment).

Owns: the part of the interface that is the same on every device (name, communication backend,
moving modules, autocast) and the list of what a subclass answers. Must not choose the device
(launch does that) nor hold process-wide state: an accelerator is a small stateless object, so
`get_accelerator()` builds one per call.
"""

from __future__ import annotations

from typing import Any

import torch

from meshboost.distributed import default_backend, get_current_device


class BaseAccelerator:
    """What scripts ask of "the accelerator": see CudaAccelerator and CpuAccelerator for the answers."""

    name: str = ""
    is_synchronous: bool = False

    @property
    def communication_backend(self) -> str:
        """The process-group backend meshboost uses with this device (nccl on CUDA, gloo on the CPU)."""
        return default_backend()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.get_current_device()}, backend={self.communication_backend})"

    def get_current_device(self) -> torch.device:
        """The device this process computes on (the same answer as `meshboost.get_current_device()`)."""
        return get_current_device()

    def set_to_device(self, models: Any) -> Any:
        """Move a module (or each module of a list) to the current device; a one-element list gives the module."""
        device = self.get_current_device()
        if isinstance(models, list):
            moved = [m.to(device) for m in models]
            return moved[0] if len(moved) == 1 else moved
        return models.to(device)

    def autocast(self, enabled: bool = True, dtype: torch.dtype = torch.float16, cache_enabled: bool = True):
        """A `torch.autocast` context for the current device type."""
        return torch.autocast(self.get_current_device().type, dtype=dtype, enabled=enabled,
                              cache_enabled=cache_enabled)

    def _refuse(self, what: str, instead: str = ""):
        raise RuntimeError(f"{type(self).__name__}.{what} has no meaning on {self.name}"
                           + (f"; {instead}" if instead else ""))
