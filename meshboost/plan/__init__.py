"""meshboost.plan: pick a parallel layout, and predict what it costs, from a model's config alone.

Owns the package's public names: `plan(...)` (also callable as `meshboost.plan(...)` once
`meshboost.plan` is imported: the module is callable), `Planner`, `Estimate`, `Layout`,
`parse_layout`, `CostConstants`. The rules live in the modules: model.py (config and meta model), calibrate.py
(measuring this machine's cost constants, or known-GPU defaults),
params.py (tp and ep splits and pipeline stages, meshboost's own), memory.py (optimizer layouts and
ZeRO padding), sharded.py (ZeRO-3's FSDP2 shards, cpu offload), activations.py (saved-for-backward bytes on fake tensors), cost.py (traffic and time),
layout.py (layouts, the plugin's checks, enumeration), planner.py (putting them together),
__main__.py (`python -m meshboost.plan`). docs/planner.md says what is modelled and what is not.
"""

from __future__ import annotations

import sys
import types

from meshboost.plan.cost import CostConstants
from meshboost.plan.layout import Layout, parse_layout
from meshboost.plan.planner import Estimate, Planner, plan

__all__ = ["plan", "Planner", "Estimate", "Layout", "parse_layout", "CostConstants"]


class _CallableModule(types.ModuleType):
    """`meshboost.plan(...)` calls `meshboost.plan.plan(...)`."""

    def __call__(self, *args, **kwargs):
        return plan(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
