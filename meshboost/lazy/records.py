"""The one record LazyInitContext keeps for a module it built: `LazyModule`, and its only accessors.

Owns: what materialisation needs to know of a module built on meta (the init seed and, for a module added
after its model, its own init; the dtype each tensor was built in; the device a move inside the context
asked for), as one typed, frozen record per module, read and replaced only through `lazy_record` and
`update_lazy_record`. Must not decide anything: `lazy/__init__.py` materialises, `moves.py` records moves.

Why the record sits in the module's `__dict__` (under `RECORD_KEY`) and not in a registry keyed by module:
`copy.deepcopy` of a lazy model must give a lazy model that materialises to the same values (ColossalAI's
tests boost such copies), and a deep copy carries a module's attributes but nothing a registry or a
parameter holds (torch's `Parameter.__deepcopy__` drops a parameter's attributes), so any other home would
make a copy forget its seed, its built dtypes and its recorded moves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

RECORD_KEY = "_meshboost_lazy"


@dataclass(frozen=True)
class LazyModule:
    """What LazyInitContext recorded for one module. A field left None was not recorded."""

    # the seed its parameters are initialised from (set when it registers a parameter in the context)
    seed: int | None = None
    # a module added after the model was built (peft's adapters) initialises itself with this instead of
    # the model's init, which never touches it; a module-level function, so deep copies share it
    init: Callable[[nn.Module], None] | None = None
    # tensor name -> the dtype it was registered (and is initialised) in, before any cast in the context;
    # never mutated: each change is a new record with a new dict
    built_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    # the device the last `.to/.cpu/.cuda` inside the context asked for, applied at materialisation
    device: torch.device | None = None


def lazy_record(module: nn.Module) -> LazyModule | None:
    """The module's record, or None when LazyInitContext recorded nothing for it."""
    return module.__dict__.get(RECORD_KEY)


def update_lazy_record(module: nn.Module, **changes) -> LazyModule:
    """Replace the module's record by one with `changes` (a new one when it had none); returns it."""
    record = replace(lazy_record(module) or LazyModule(), **changes)
    module.__dict__[RECORD_KEY] = record
    return record
