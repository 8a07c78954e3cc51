"""The package's floors (docs/design.md), checked on the source: every import inside `meshboost/`
(module level and inside functions) goes to its own package or to a strictly lower floor, no
private name crosses a package boundary, the module import graph has no cycle, and no module
outgrows one reader's sitting. Run as a script to print the package graph:

    python tests/test_architecture.py

Implicit edges to parent packages (importing `meshboost.distributed` runs `meshboost/__init__`)
are not counted: only what a file names.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "meshboost"
FLOORS = {
    "distributed": 0,                                               # the ground floor
    "shardformer": 1, "pipeline": 1, "optim": 1, "checkpoint": 1,   # peers: none imports another
    "lazy": 1,                                                      # LazyInitContext: init on meta, per unit
    "cluster": 1, "accelerator": 1, "nn": 1, "utils": 1,            # ColossalAI's paths: views over distributed
    "booster": 2,
    "plugins": 3,                                                   # composition only
    "testing": 4,                                                   # test support: nothing imports it
}
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _resolve(target: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """`from target import names`: a name that is a submodule is an edge to that submodule."""
    out = [f"{target}.{n}" for n in names if f"{target}.{n}" in modules]
    if len(out) < len(names):
        out.append(target)
    return out


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported meshboost module, names taken from it, line) for every import in the file."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "meshboost"]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "meshboost":
                continue
            names = [a.name for a in node.names]
            for resolved in _resolve(target, names, modules):
                taken = names if resolved == target else []
                out.append((resolved, taken, node.lineno))
    return out


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def _cross_package_private_attributes(path: Path, modules: dict[str, Path]) -> list[str]:
    """`from meshboost.other import mod` then `mod._private`: reaching into another package."""
    mine = _package(_module_name(path))
    tree = ast.parse(path.read_text(), str(path))
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("meshboost"):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules and _package(full) != mine:
                    aliases[a.asname or a.name] = full
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("meshboost") and a.asname and _package(a.name) != mine:
                    aliases[a.asname] = a.name
    return [f"{path.relative_to(ROOT.parent)}:{node.lineno} {aliases[node.value.id]}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            and node.attr.startswith("_") and not node.attr.startswith("__")]


def package_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        src = _package(module)
        for target, _, _ in _imports(path, modules):
            dst = _package(target)
            if src and dst and dst != src:
                graph[src].add(dst)
    return graph


def test_every_package_has_a_floor():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(FLOORS), f"packages without a floor: {packages - set(FLOORS)}; gone: {set(FLOORS) - packages}"
    top = sorted(p.name for p in ROOT.glob("*.py") if p.name != "__init__.py")
    assert not top, f"modules outside any package: {top} (give each a package with a floor)"


def test_imports_only_go_down():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        src = _package(module)
        if src is None:                       # meshboost/__init__.py: the public names, above everything
            continue
        for target, names, line in _imports(path, modules):
            dst = _package(target)
            where = f"{path.relative_to(ROOT.parent)}:{line} imports {target}"
            if dst is None:
                wrong.append(f"{where} (the top-level package, above every floor)")
            elif dst != src and FLOORS[dst] >= FLOORS[src]:
                wrong.append(f"{where} ({dst} is on floor {FLOORS[dst]}, {src} on floor {FLOORS[src]})")
            elif dst != src and any(n.startswith("_") for n in names):
                wrong.append(f"{where} {[n for n in names if n.startswith('_')]} (a private name of another package)")
        wrong += [f"{w} (a private name of another package)" for w in _cross_package_private_attributes(path, modules)]
    assert not wrong, "imports against the floors:\n" + "\n".join(wrong)


def test_module_graph_has_no_cycle():
    modules = _modules()
    graph = {m: {t for t, _, _ in _imports(p, modules) if t in modules and t != m} for m, p in modules.items()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_modules_are_one_sitting():
    long = {str(p.relative_to(ROOT.parent)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split by idea): {long}"


if __name__ == "__main__":
    graph = package_graph()
    for pkg in sorted(FLOORS, key=lambda p: (FLOORS[p], p)):
        below = ", ".join(sorted(graph.get(pkg, ()), key=lambda p: (FLOORS[p], p))) or "-"
        print(f"floor {FLOORS[pkg]}  {pkg:12s} imports: {below}")
    failures = 0
    for test in (test_every_package_has_a_floor, test_imports_only_go_down, test_module_graph_has_no_cycle,
                 test_modules_are_one_sitting):
        try:
            test()
        except AssertionError as e:
            failures += 1
            print(f"FAIL {test.__name__}: {e}")
    print("ok: no arrow up, no cycle" if not failures else f"{failures} check(s) failed")
    sys.exit(1 if failures else 0)
