"""CudaAccelerator: ColossalAI's accelerator interface on CUDA, each call torch.cuda's own on the
device this process was bound to (launch binds cuda:LOCAL_RANK). Must not pick another device."""

from __future__ import annotations

import os

import torch

from meshboost.accelerator.base import BaseAccelerator


class CudaAccelerator(BaseAccelerator):
    name = "cuda"

    # -- device ---------------------------------------------------------------------------------
    def get_version(self) -> str:
        return torch.version.cuda or ""

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def set_device(self, device: torch.device | int | None = None) -> None:
        """Bind this process to `device`; None: cuda:LOCAL_RANK (modulo the devices here), as launch does."""
        if device is None:
            device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        torch.cuda.set_device(device)

    def get_device_name(self, device=None) -> str:
        return torch.cuda.get_device_name(device)

    def synchronize(self, device=None) -> None:
        torch.cuda.synchronize(device)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def get_device_capability(self, device=None) -> tuple[int, int]:
        return torch.cuda.get_device_capability(device)

    def get_device_properties(self, device):
        return torch.cuda.get_device_properties(device)

    def utilization(self, device=None) -> int:
        return torch.cuda.utilization(device)

    # -- random numbers ---------------------------------------------------------------------------
    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return torch.cuda.get_rng_state(device)

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return torch.cuda.get_rng_state_all()

    def set_rng_state(self, new_state: torch.Tensor, device="cuda") -> None:
        torch.cuda.set_rng_state(new_state, device)

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        torch.cuda.set_rng_state_all(new_states)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def seed(self) -> None:
        torch.cuda.seed()

    def seed_all(self) -> None:
        torch.cuda.seed_all()

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    # -- memory -----------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_stats(self, device=None) -> dict:
        return torch.cuda.memory_stats(device)

    def memory_summary(self, device=None, abbreviated: bool = False) -> str:
        return torch.cuda.memory_summary(device, abbreviated)

    def memory_snapshot(self):
        return torch.cuda.memory_snapshot()

    def memory_allocated(self, device=None) -> int:
        return torch.cuda.memory_allocated(device)

    def max_memory_allocated(self, device=None) -> int:
        return torch.cuda.max_memory_allocated(device)

    def reset_max_memory_allocated(self, device=None) -> None:
        torch.cuda.reset_peak_memory_stats(device)      # torch's own reset_max_memory_allocated calls this

    def reset_max_memory_cached(self, device=None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def memory_reserved(self, device=None) -> int:
        return torch.cuda.memory_reserved(device)

    def max_memory_reserved(self, device=None) -> int:
        return torch.cuda.max_memory_reserved(device)

    def set_per_process_memory_fraction(self, fraction: float, device=None) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)

    def reset_peak_memory_stats(self, device=None) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    # -- streams and events -----------------------------------------------------------------------
    def Stream(self, device=None, priority: int = 0, **kwargs):
        return torch.cuda.Stream(device, priority, **kwargs)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return torch.cuda.Event(enable_timing, blocking, interprocess)

    def current_stream(self, device=None):
        return torch.cuda.current_stream(device)

    def default_stream(self, device=None):
        return torch.cuda.default_stream(device)

    def set_stream(self, stream_) -> None:
        torch.cuda.set_stream(stream_)

    def stream(self, stream_):
        return torch.cuda.stream(stream_)
