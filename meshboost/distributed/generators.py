"""The random generators a process draws from: the CPU's, and the one of the accelerator its tensors live on.

Owns: `device_generators`, the one place that knows how each device type exposes its generator (a
`default_generators` list filled lazily by CUDA / XPU, or only module-level state functions, as on MPS).
Must not seed nor restore anything: the dropout streams under tensor parallelism (shardformer/rng.py)
and the pipeline step's generator agreement (pipeline/generators.py) decide what to do with them.
"""

from __future__ import annotations

import torch


class ModuleGenerator:
    """A device whose module has no `default_generators` list (MPS): its state and seed functions,
    shaped like a `torch.Generator` for what the callers use (get_state, set_state, manual_seed)."""

    def __init__(self, module):
        self.module = module

    def get_state(self) -> torch.Tensor:
        return self.module.get_rng_state()

    def set_state(self, state: torch.Tensor) -> None:
        self.module.set_rng_state(state)

    def manual_seed(self, seed: int) -> None:
        self.module.manual_seed(seed)


def device_generators(device: torch.device) -> list:
    """The CPU generator, then the generator of `device` when it is an accelerator."""
    found = [torch.default_generator]
    if device.type in ("cpu", "meta"):
        return found
    module = torch.get_device_module(device.type)
    listed = getattr(module, "default_generators", None)
    if listed is not None and not listed and hasattr(module, "init"):
        module.init()                     # CUDA / XPU fill their generator list lazily
        listed = module.default_generators
    if not listed:
        return found + [ModuleGenerator(module)]
    index = device.index if device.index is not None else module.current_device()
    return found + [listed[index]]
