"""CpuAccelerator: ColossalAI's accelerator interface when this process computes on the CPU.

Where the CPU has a real answer it is given: one device, synchronous (synchronize and
empty_cache do nothing), torch's CPU generator for seeds and RNG states, `torch.cpu` streams, and
the process's resident memory for `memory_reserved` / `max_memory_reserved`. The CPU has no
device allocator, so `memory_allocated` / `max_memory_allocated` are 0 and the peak resets do
nothing. Questions only a GPU can answer (capability, properties, utilization, allocator
statistics, a memory fraction) raise a RuntimeError saying so. (ColossalAI's CPU accelerator
raises for most of these; scripts that time or seed through it then stop on a CPU.)
"""

from __future__ import annotations

import os
import resource
import sys

import torch

from meshboost.accelerator.base import BaseAccelerator


def _resident_bytes() -> int:
    """The process's resident set now (Linux /proc), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_resident_bytes()


def _peak_resident_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024      # kilobytes on Linux, bytes on macOS


class CpuAccelerator(BaseAccelerator):
    name = "cpu"
    is_synchronous = True

    # -- device ---------------------------------------------------------------------------------
    def get_version(self) -> str:
        return ""

    def current_device(self) -> int:
        """0: the index of the one CPU device (device_count() is 1)."""
        return 0

    def set_device(self, device: torch.device | int | str | None = None) -> None:
        """Nothing to bind on the CPU; anything but the CPU itself is an error."""
        if device is None or (isinstance(device, int) and device == 0) or str(device) == "cpu" or (
                isinstance(device, torch.device) and device.type == "cpu"):
            return
        raise RuntimeError(f"set_device({device!r}): this process computes on the CPU (CUDA is not available)")

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def synchronize(self, device=None) -> None:
        """CPU operations complete before they return: nothing to wait for."""

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def get_device_capability(self, device=None):
        self._refuse("get_device_capability", "it is a CUDA compute capability")

    def get_device_properties(self, device=None):
        self._refuse("get_device_properties", "it describes a CUDA device")

    def utilization(self, device=None):
        self._refuse("utilization", "it is a GPU's busy percentage from nvidia-smi")

    # -- random numbers: torch's CPU generator ----------------------------------------------------
    def get_rng_state(self, device=None) -> torch.Tensor:
        return torch.get_rng_state()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [torch.get_rng_state()]

    def set_rng_state(self, new_state: torch.Tensor, device=None) -> None:
        torch.set_rng_state(new_state)

    def set_rng_state_all(self, new_states: list[torch.Tensor]) -> None:
        if len(new_states) != 1:
            raise ValueError(f"set_rng_state_all got {len(new_states)} states; the CPU has one generator")
        torch.set_rng_state(new_states[0])

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def seed(self) -> None:
        torch.seed()

    def seed_all(self) -> None:
        torch.seed()

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # -- memory -----------------------------------------------------------------------------------
    def empty_cache(self) -> None:
        """The CPU allocator keeps no cache to release."""

    def memory_allocated(self, device=None) -> int:
        """0: the CPU has no device allocator (memory_reserved gives the process's resident memory)."""
        return 0

    def max_memory_allocated(self, device=None) -> int:
        """0: the CPU has no device allocator (max_memory_reserved gives the process's peak memory)."""
        return 0

    def memory_reserved(self, device=None) -> int:
        """Bytes the process holds in memory now (its resident set)."""
        return _resident_bytes()

    def max_memory_reserved(self, device=None) -> int:
        """The process's peak resident memory in bytes (since it started: it cannot be reset)."""
        return _peak_resident_bytes()

    def reset_max_memory_allocated(self, device=None) -> None:
        """Nothing to reset (see max_memory_allocated)."""

    def reset_max_memory_cached(self, device=None) -> None:
        """Nothing to reset (see max_memory_allocated)."""

    def reset_peak_memory_stats(self, device=None) -> None:
        """Nothing to reset: allocated memory is always 0, and the peak resident memory is the process's."""

    def memory_stats(self, device=None):
        self._refuse("memory_stats", "the CPU has no caching allocator; see memory_reserved()")

    def memory_summary(self, device=None, abbreviated: bool = False):
        self._refuse("memory_summary", "the CPU has no caching allocator; see memory_reserved()")

    def memory_snapshot(self):
        self._refuse("memory_snapshot", "the CPU has no caching allocator; see memory_reserved()")

    def set_per_process_memory_fraction(self, fraction: float, device=None):
        self._refuse("set_per_process_memory_fraction", "limit the process's memory with the operating system")

    # -- streams and events: torch.cpu's (CPU work is in order, they synchronise nothing) ---------
    def Stream(self, device=None, priority: int = 0, **kwargs):
        return torch.cpu.Stream(priority)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        return torch.cpu.Event()

    def current_stream(self, device=None):
        return torch.cpu.current_stream(device)

    def default_stream(self, device=None):
        return torch.cpu.current_stream(device)

    def set_stream(self, stream_):
        self._refuse("set_stream", "CPU work has one stream; use `with accelerator.stream(s):`")

    def stream(self, stream_):
        return torch.cpu.stream(stream_)
