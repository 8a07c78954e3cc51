"""Serves the files of `meshboost/compat/` under ColossalAI's module names.

Owns: the one rule `meshboost.<path>` -> `meshboost/compat/<path>.py` (or `<path>/__init__.py`),
applied only to names the core does not have, and the finder (PEP 451 `MetaPathFinder`) that applies
it on first import. Each file is loaded once, under its ColossalAI name; a package's submodules
are found in its own folder. Nothing is imported before a script asks for it (so `import meshboost`
still imports neither the plugins nor transformers). Must not import anything of meshboost: the
top-level package installs the finder before any other meshboost module is imported.

Why a finder: the ColossalAI names sit inside core packages (`meshboost.booster.plugin`,
`meshboost.pipeline.stage_manager`) that must not import the floors above them. The import system
already knows how to attach a module to its parent; a finder is its documented hook for "this
name's source is over there", where a `__getattr__` put on another module, or files in the core
packages, would hide an upward import from the architecture test.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent          # meshboost/compat
CORE = ROOT.parent                               # meshboost/


def mirror_file(name: str) -> Path | None:
    """The compat file that is module `name` (`meshboost.a.b` -> compat/a/b.py or compat/a/b/__init__.py),
    or None: not a meshboost name, a compat-internal name, or one the core has itself."""
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "meshboost" or parts[1] == "compat":
        return None
    relative = Path(*parts[1:])
    if (CORE / relative).with_suffix(".py").is_file() or (CORE / relative / "__init__.py").is_file():
        return None                              # a core module: never shadowed
    for candidate in ((ROOT / relative).with_suffix(".py"), ROOT / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


class ColossalAIPaths(importlib.abc.MetaPathFinder):
    """Finds `meshboost.<path>` in `meshboost/compat/<path>` (see `mirror_file`)."""

    def find_spec(self, name, path=None, target=None):
        found = mirror_file(name)
        if found is None:
            return None
        package = [str(found.parent)] if found.name == "__init__.py" else None
        return importlib.util.spec_from_file_location(name, found, submodule_search_locations=package)


def install() -> None:
    """Put the finder first on `sys.meta_path` (once per process; idempotent)."""
    if not any(isinstance(f, ColossalAIPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, ColossalAIPaths())
