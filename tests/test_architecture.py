"""The package's floors (docs/design.md), checked on the source: every import inside `meshboost/`
(module level and inside functions) goes to its own package or to a strictly lower floor, no
private name crosses a package boundary, the module import graph has no cycle, and no module
outgrows one reader's sitting. Run as a script to print the package graph:

    python tests/test_architecture.py

Implicit edges to parent packages (importing `meshboost.distributed` runs `meshboost/__init__`)
are not counted: only what a file names. A ColossalAI path that `meshboost.compat` serves
(`meshboost.booster.plugin` is the file `compat/booster/plugin/__init__.py`, by the rule of
`compat/paths.py`) counts as an import of that compat module, so the core cannot reach compat through
one; no module puts a `__getattr__` on another, and no compat file shadows a core module.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "meshboost"


def _load_paths_rule():
    """compat/paths.py (the rule the ColossalAI paths are served by) loaded as a lone file: importing it as
    `meshboost.compat.paths` would run `meshboost/__init__` and with it torch, and this test reads source only,
    so it runs on a machine without torch (`python3 tests/test_architecture.py`)."""
    spec = importlib.util.spec_from_file_location("_meshboost_paths_rule", ROOT / "compat" / "paths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mirror_file = _load_paths_rule().mirror_file

FLOORS = {
    "distributed": 0,                                               # the ground floor
    "lazy": 1,                                                      # LazyInitContext: init on meta, per unit
    "shardformer": 2, "pipeline": 2, "optim": 2, "checkpoint": 2,   # peers: none imports another
    "booster": 3, "fsdp": 3,                                        # peers; fsdp: the FSDP2 engine (distributed, optim)
    "plugins": 4,                                                   # composition only
    "testing": 5,                                                   # test support: nothing imports it
    "post_training": 5,                                             # log-probs, references, preference losses on a boosted model
    "plan": 6,                                                      # the layout planner: plugins' rules; spawns
    "compat": 7,                                                    # ColossalAI's surface: nothing imports it
    "check": 7,                                                     # the pre-flight check: plan and testing; nothing imports it
}
MAX_LINES = 400         # a file: one reader's sitting (split by concern before it fills)
MAX_FUNCTION_LINES = 80  # a function: one screen


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


def _physical(name: str, modules: dict[str, Path]) -> str:
    """The module a name is loaded from: a ColossalAI path served by compat is that compat file."""
    if name in modules:
        return name
    served = mirror_file(name)
    return _module_name(served) if served is not None else name


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], int]]:
    """(imported meshboost module, names taken from it, line) for every import in the file."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(_physical(a.name, modules), [], node.lineno) for a in node.names
                    if a.name.split(".")[0] == "meshboost"]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "meshboost":
                continue
            names = [a.name for a in node.names]
            target = _physical(target, modules)
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


def test_functions_are_one_screen():
    long = [f"{p.relative_to(ROOT.parent)}:{node.lineno} {node.name} ({n} lines)" for p in sorted(ROOT.rglob("*.py"))
            for node in ast.walk(ast.parse(p.read_text(), str(p)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split by step):\n" + "\n".join(long)


def test_compat_is_the_top_floor_and_nothing_imports_it():
    """ColossalAI's surface sits on the top floor; no other package (ColossalAI paths included) imports it."""
    assert FLOORS["compat"] == max(FLOORS.values())
    modules = _modules()
    wrong = [f"{path.relative_to(ROOT.parent)}:{line} imports {target}" for module, path in modules.items()
             if _package(module) not in (None, "compat")
             for target, _, line in _imports(path, modules) if _package(target) == "compat"]
    assert not wrong, "core modules importing meshboost.compat (directly or through a ColossalAI path):\n" + \
        "\n".join(wrong)


def _patches_getattr(node: ast.AST) -> bool:
    """`x.__getattr__ = ...` or `setattr(x, "__getattr__", ...)` (a class or module defining its own is fine)."""
    if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Attribute) and t.attr == "__getattr__" for t in targets)
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
            and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == "__getattr__")


def test_no_module_puts_a_getattr_on_another():
    """A `__getattr__` assigned onto another module is an import the floors cannot see."""
    wrong = [f"{p.relative_to(ROOT.parent)}:{node.lineno}" for p in sorted(ROOT.rglob("*.py"))
             for node in ast.walk(ast.parse(p.read_text(), str(p))) if _patches_getattr(node)]
    assert not wrong, "modules assigning __getattr__ onto another object: " + ", ".join(wrong)


def test_gradient_hooks_go_through_param_info():
    """Every gradient hook meshboost puts on a parameter is registered by `param_info.register_grad_hook`,
    which records it, so moving a parameter's records (FSDP2's replacement DTensors) carries its hooks
    without reading torch's private `_backward_hooks` table."""
    allowed = ROOT / "distributed" / "param_info.py"
    wrong = [f"{p.relative_to(ROOT.parent)}:{node.lineno}" for p in sorted(ROOT.rglob("*.py")) if p != allowed
             for node in ast.walk(ast.parse(p.read_text(), str(p)))
             if isinstance(node, ast.Attribute) and node.attr == "register_hook"
             or isinstance(node, ast.Attribute) and node.attr == "_backward_hooks"
             and not (isinstance(node.value, ast.Name) and node.value.id == "module")]
    assert not wrong, "gradient hooks registered or read outside param_info: " + ", ".join(wrong)


def test_compat_serves_only_names_the_core_lacks():
    """Every compat file is served under its ColossalAI name, never in place of a core module, and its
    parent is a real package (core or compat)."""
    modules = _modules()
    wrong = []
    for module in modules:
        if _package(module) != "compat" or module in ("meshboost.compat", "meshboost.compat.paths"):
            continue
        name = "meshboost." + module[len("meshboost.compat."):]
        if name in modules and modules[module].name == "__init__.py" and modules[name].name == "__init__.py":
            # a folder of paths inside a core package (compat/booster/ for booster.accelerator...): its
            # __init__ is a docstring (so packaging finds the folder), never served
            body = ast.parse(modules[module].read_text()).body
            if not (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)):
                wrong.append(f"{module} is the folder of a core package's paths: it must hold only a docstring")
        elif name in modules:
            wrong.append(f"{module} would shadow the core module {name}")
        elif mirror_file(name) is None or _module_name(mirror_file(name)) != module:
            wrong.append(f"{module} is not served as {name}")
        elif (parent := name.rpartition(".")[0]) not in modules and mirror_file(parent) is None:
            wrong.append(f"{name}: its parent {parent} is no package")
    assert not wrong, "\n".join(wrong)


def test_runs_without_torch():
    """This file reads source only: run as a script in a fresh interpreter where importing torch fails, it
    must still pass (a package import that loads the accelerator would fail here)."""
    import subprocess
    blocker = ("import sys, runpy\n"
               "class NoTorch:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] in ('torch', 'transformers'):\n"
               "            raise ImportError('architecture test must not import ' + name)\n"
               "sys.meta_path.insert(0, NoTorch())\n"
               f"sys.argv = [{str(Path(__file__))!r}]\n"
               f"runpy.run_path({str(Path(__file__))!r}, run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


def test_plan_imports_nothing_from_testing():
    """The planner is a tool users run: test support (`meshboost.testing`, a floor below it) stays out of
    it; what it needs to start processes is the runtime's (`meshboost.distributed.local`)."""
    modules = _modules()
    wrong = [f"{path.relative_to(ROOT.parent)}:{line} imports {target}" for module, path in modules.items()
             if _package(module) == "plan"
             for target, _, line in _imports(path, modules) if _package(target) == "testing"]
    assert not wrong, "meshboost.plan importing meshboost.testing:\n" + "\n".join(wrong)


if __name__ == "__main__":
    graph = package_graph()
    for pkg in sorted(FLOORS, key=lambda p: (FLOORS[p], p)):
        below = ", ".join(sorted(graph.get(pkg, ()), key=lambda p: (FLOORS[p], p))) or "-"
        print(f"floor {FLOORS[pkg]}  {pkg:12s} imports: {below}")
    failures = 0
    for test in (test_every_package_has_a_floor, test_imports_only_go_down, test_module_graph_has_no_cycle,
                 test_modules_are_one_sitting, test_compat_is_the_top_floor_and_nothing_imports_it,
                 test_no_module_puts_a_getattr_on_another, test_compat_serves_only_names_the_core_lacks,
                 test_gradient_hooks_go_through_param_info, test_functions_are_one_screen,
                 test_plan_imports_nothing_from_testing):
        try:
            test()
        except AssertionError as e:
            failures += 1
            print(f"FAIL {test.__name__}: {e}")
    print("ok: no arrow up, no cycle" if not failures else f"{failures} check(s) failed")
    sys.exit(1 if failures else 0)


# the mesh dimensions the data-parallel axis unfolds into: only dims.py says which stand behind which axis
DP_DIMENSIONS = {"dp", "edp", "ep", "dp_replicate", "dp_shard", "edp_shard"}
LAYOUT_ALGEBRA = "meshboost.distributed.dims"
# who may read the dims' raw dimension names: the mesh builder, to name the DeviceMesh's dimensions
RAW_DIMENSION_READERS = {("meshboost.distributed.mesh", "__init__"), ("meshboost.distributed.mesh", "_timeout_override")}


def _axis_map_entries(node: ast.Dict) -> list[str]:
    """The entries of dict literal `node` that map a data-parallel axis to a tuple of other dp dimensions."""
    out = []
    for key, value in zip(node.keys, node.values):
        if isinstance(key, ast.Constant) and key.value in DP_DIMENSIONS and isinstance(value, (ast.Tuple, ast.List)):
            named = {e.value for e in value.elts if isinstance(e, ast.Constant)} & DP_DIMENSIONS
            if named - {key.value}:
                out.append(f"{key.value!r} -> {sorted(named)}")
    return out


def test_only_dims_maps_logical_axes_to_mesh_dimensions():
    """The layout algebra is written once (distributed/dims.py, issue 57): no other module holds an axis
    map ("dp" -> ("edp", "ep")), and only the mesh builder reads the dims' raw dimension names (`mesh_axes`,
    to name the DeviceMesh's); everyone else asks for logical axes (`mesh.group("dp")`,
    `dims.groups("edp")`, `dims.mesh_dims(...)`)."""
    bad = []
    for name, path in _modules().items():
        if name == LAYOUT_ALGEBRA:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for function in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))]:
            scope = getattr(function, "name", None)
            body = function.body if isinstance(function, ast.Module) else [function]
            for node in (n for b in body for n in ast.walk(b)):
                if isinstance(node, ast.Dict) and _axis_map_entries(node):
                    bad.append(f"{name}:{node.lineno} maps axes to mesh dimensions: {_axis_map_entries(node)}")
                if (isinstance(node, ast.Attribute) and node.attr == "mesh_axes" and scope is not None
                        and (name, scope) not in RAW_DIMENSION_READERS):
                    bad.append(f"{name}:{node.lineno} ({scope}) reads mesh_axes: ask dims.mesh_dims / dims.groups")
    assert not bad, "layout algebra outside distributed/dims.py:\n" + "\n".join(sorted(set(bad)))
