"""ColossalAI's `colossalai.utils` helpers that its example scripts import, as views over meshboost.

Owns: nothing of its own. `get_current_device` and `set_seed` are meshboost.distributed's;
`conditional_context` and `ensure_path_exists` are the two small context/path helpers ColossalAI's
scripts call. Must not grow a second implementation of anything meshboost.distributed has.
"""

from __future__ import annotations

import contextlib
import os

from meshboost.distributed import get_current_device, set_seed

__all__ = ["get_current_device", "set_seed", "conditional_context", "ensure_path_exists"]


def conditional_context(context_manager, enable: bool = True):
    """`context_manager` when `enable`, else a context that does nothing."""
    return context_manager if enable else contextlib.nullcontext()


def ensure_path_exists(filename: str) -> None:
    """Create the folder that will hold `filename` (no-op when it has none or it exists)."""
    folder = os.path.dirname(filename)
    if folder:
        os.makedirs(folder, exist_ok=True)
