"""HybridAdam, FusedAdam and CPUAdam: ColossalAI's Adam signatures on `torch.optim.Adam`.

Owns: mapping ColossalAI's arguments onto torch's Adam (adamw_mode=True is AdamW's decoupled
weight decay, False Adam's L2 penalty), choosing torch's kernel per parameter group at each step
from where its parameters are (fused on CUDA, foreach elsewhere, the CPU included) and refusing
what torch's Adam cannot do. No kernel of its own: the numbers are torch's, so HybridAdam steps
equal `torch.optim.AdamW` steps. The state is torch's (`exp_avg`, `exp_avg_sq`, `step`), on each
parameter's device, so meshboost's optimizer wrappers and checkpoints treat it as any Adam.
"""

from __future__ import annotations

from typing import Any

import torch

_FUSED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _check(name: str, bias_correction: bool, nvme_offload_fraction: float, extra: dict) -> None:
    if not bias_correction:
        raise NotImplementedError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the "
                                  "moment estimates' bias; drop the argument")
    if nvme_offload_fraction:
        raise NotImplementedError(f"{name}(nvme_offload_fraction={nvme_offload_fraction}): meshboost has no NVMe "
                                  "offload of optimizer states; drop it (ZeRO partitions the states over data-parallel "
                                  "ranks instead: LowLevelZeroPlugin or HybridParallelPlugin(zero_stage=1))")
    if extra:
        raise TypeError(f"{name} got unsupported arguments {sorted(extra)}; it takes ColossalAI's (lr, betas, eps, "
                        "weight_decay, adamw_mode, bias_correction, nvme_offload_fraction/dir) and amsgrad; use "
                        "torch.optim.AdamW for torch's other options")


class _TorchAdam(torch.optim.Adam):
    """torch.optim.Adam whose kernel follows the parameters: fused when every parameter of a group is a
    floating-point CUDA tensor, foreach otherwise. Decided at every step, so it stays right after
    `booster.boost` moves the parameters (or swaps in fp32 master copies) and after a state load."""

    def __init__(self, params, lr, betas, eps, weight_decay, adamw_mode: bool, amsgrad: bool):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adamw_mode)
        self.adamw_mode = adamw_mode

    def _choose_kernel(self, group: dict) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        fused = bool(params) and all(p.is_cuda and p.dtype in _FUSED_DTYPES for p in params)
        group["fused"], group["foreach"] = fused, not fused
        for p in params:
            step = self.state.get(p, {}).get("step")
            # fused kernels read the step count on the parameter's device (in fp32); foreach reads it on the CPU
            if torch.is_tensor(step):
                want = (p.device, torch.float32) if fused else (torch.device("cpu"), step.dtype)
                if (step.device, step.dtype) != want:
                    self.state[p]["step"] = step.to(*want)

    def step(self, closure=None):
        for group in self.param_groups:
            self._choose_kernel(group)
        return super().step(closure)


class HybridAdam(_TorchAdam):
    """ColossalAI's HybridAdam: Adam with decoupled weight decay (`adamw_mode=True`, i.e. AdamW; False:
    Adam's L2 penalty) on whatever device each parameter is, CPU included. `nvme_offload_fraction`
    must be 0 (no NVMe offload); `nvme_offload_dir` is then unused, as in ColossalAI. Other keyword
    arguments (ColossalAI ignores them silently) are refused, except `amsgrad`, which torch honours."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 adamw_mode: bool = True, nvme_offload_fraction: float = 0.0, nvme_offload_dir: str | None = None,
                 **defaults: Any):
        amsgrad = bool(defaults.pop("amsgrad", False))
        _check(type(self).__name__, bias_correction, nvme_offload_fraction, defaults)
        super().__init__(model_params, lr, betas, eps, weight_decay, adamw_mode, amsgrad)


class CPUAdam(HybridAdam):
    """ColossalAI's CPUAdam (meant for CPU parameters): the same optimizer as HybridAdam, without **kwargs."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0,
                 adamw_mode: bool = True, nvme_offload_fraction: float = 0.0, nvme_offload_dir: str | None = None):
        super().__init__(model_params, lr, bias_correction, betas, eps, weight_decay, adamw_mode,
                         nvme_offload_fraction, nvme_offload_dir)


class FusedAdam(_TorchAdam):
    """ColossalAI's FusedAdam (a CUDA kernel there; here torch's, fused on CUDA and foreach elsewhere).
    set_grad_none: what `zero_grad()` does by default (set gradients to None, or zero them)."""

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adamw_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True):
        _check(type(self).__name__, bias_correction, 0.0, {})
        super().__init__(params, lr, betas, eps, weight_decay, adamw_mode, amsgrad)
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)
