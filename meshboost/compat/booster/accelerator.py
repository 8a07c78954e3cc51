"""ColossalAI's `booster.accelerator.Accelerator`: a device name, and moving a model onto it.

A thin view: the device is a name ColossalAI accepts ("cpu", "cuda"), `bind()` makes it this process's
device as `meshboost.get_current_device()` chose it (cuda:LOCAL_RANK; ColossalAI binds plain "cuda"),
`configure_model` moves the model there. meshboost's Booster places models through its plugin's mesh
and never asks for one of these.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from meshboost.distributed import get_current_device

SUPPORTED_DEVICES = ("cpu", "cuda")


class Accelerator:
    """The hardware a model runs on: `Accelerator("cuda").configure_model(model)`."""

    def __init__(self, device: str):
        if device not in SUPPORTED_DEVICES:
            raise ValueError(f"Accelerator(device={device!r}): expected one of {SUPPORTED_DEVICES}")
        if device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("Accelerator(device='cuda'): CUDA is not available here; use 'cpu'")
        self.device = device

    def _torch_device(self) -> torch.device:
        current = get_current_device()
        return current if current.type == self.device else torch.device(self.device)

    def bind(self) -> None:
        """Make this accelerator's device the current one (CUDA: the process's own cuda:LOCAL_RANK)."""
        if self.device == "cuda":
            torch.cuda.set_device(self._torch_device())

    def configure_model(self, model: nn.Module) -> nn.Module:
        """`model`, moved to the device (in place, as `nn.Module.to`)."""
        return model.to(self._torch_device())
