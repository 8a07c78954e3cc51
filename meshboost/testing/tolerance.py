"""The one table of numerical tolerances used by every equivalence test: dtype -> (rtol, atol)."""

from __future__ import annotations

import torch

TOLERANCE = {
    torch.float32: (1e-4, 1e-5),   # tensors; fp32 losses are held to 1e-5 (LOSS_ATOL)
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (2e-2, 2e-2),
}

# Loss tolerances demanded by the issues (absolute difference of scalar losses).
LOSS_ATOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 5e-3}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype = torch.float32, msg: str = "",
                 scale: float = 1.0) -> None:
    """torch.testing.assert_close with the table's tolerance for `dtype` (times `scale`)."""
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol * scale, atol=atol * scale,
                               msg=lambda m: f"{msg}: {m}")
