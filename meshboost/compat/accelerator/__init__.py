"""ColossalAI's `accelerator` package: `get_accelerator()` answers for the device this process
computes on, as `meshboost.distributed.get_current_device` reads it from the environment (its
CUDA device when CUDA is available, else the CPU). There is no process-wide accelerator to set:
each call builds a small stateless object, so `set_accelerator` / `auto_set_accelerator` are not
provided (launch decides the device). See docs/colossalai.md."""

from meshboost.accelerator.base import BaseAccelerator
from meshboost.accelerator.cpu import CpuAccelerator
from meshboost.accelerator.cuda import CudaAccelerator
from meshboost.distributed import get_current_device


def get_accelerator() -> BaseAccelerator:
    """The accelerator of the device this process computes on (CudaAccelerator or CpuAccelerator)."""
    return CudaAccelerator() if get_current_device().type == "cuda" else CpuAccelerator()


__all__ = ["get_accelerator", "BaseAccelerator", "CudaAccelerator", "CpuAccelerator"]
