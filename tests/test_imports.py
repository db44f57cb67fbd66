"""No import cycles anywhere in zerorun/: dependencies point one way (docs/architecture.md).

Modules must not import each other in a circle, and neither may subpackages (zerorun.runtime,
zerorun.launch, ...) taken as wholes. Every `import` counts, wherever it is written: at module level, inside a function (a lazy import is
still a dependency), and under `if TYPE_CHECKING:` (a type the module needs is a dependency too).
`from pkg import name` depends on `pkg.name` when that is a module, else on `pkg`. Importing a
submodule is not counted as importing its parent package's `__init__` (that is Python's mechanics,
not the design); a package `__init__` that imports its own submodules is.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1] / "zerorun"


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from its package upwards
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in files and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph with each subpackage (zerorun.runtime, zerorun.launch, ...) as one node."""
    def node(module: str) -> str:
        parts = module.split(".")
        package = ".".join(parts[:2])
        return package if len(parts) > 2 or (ROOT.parent / package.replace(".", "/")).is_dir() else module

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        out.setdefault(node(module), set()).update(node(t) for t in targets if node(t) != node(module))
    return out


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = _graph()
    assert "zerorun.runtime.checkpoint.sharded" in graph["zerorun.runtime.engine"]  # imported inside a method
    assert "zerorun.runtime.engine" in graph["zerorun"]  # imported under TYPE_CHECKING and lazily


def _runtime_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The runtime's own graph with each of its subpackages (comm, offload, stage3, ...) as one node."""
    def node(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:3]) if parts[:2] == ["zerorun", "runtime"] and len(parts) > 3 else module

    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module.startswith("zerorun.runtime."):
            out.setdefault(node(module), set()).update(
                node(t) for t in targets if t.startswith("zerorun.runtime.") and node(t) != node(module))
    for targets in out.values():
        targets &= set(out)
    return out


def _all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    return _cycles(graph) + _cycles(_packages(graph)) + _cycles(_runtime_packages(graph))


def test_runtime_subpackages_are_nodes_of_their_own() -> None:
    graph = {"zerorun.runtime.comm.a": {"zerorun.runtime.store"}, "zerorun.runtime.store": {"zerorun.runtime.comm.b"},
             "zerorun.runtime.comm.b": set()}
    assert _cycles(graph) == [] and _cycles(_runtime_packages(graph)) == [["zerorun.runtime.comm", "zerorun.runtime.store"]]


def test_no_import_cycle_anywhere_in_zerorun() -> None:
    cycles = _all_cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_telemetry_does_not_import_launch() -> None:
    """The launcher feeds telemetry; telemetry (also read by `zerorun report` after the job) needs no launcher."""
    graph = _graph()
    assert {(m, d) for m, deps in graph.items() if m.startswith("zerorun.telemetry")
            for d in deps if d.startswith("zerorun.launch")} == set()


def test_the_cycle_finder_finds_module_and_package_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = {"zerorun.x.m": {"zerorun.y.n"}, "zerorun.y.n": set(), "zerorun.y.k": {"zerorun.x.j"}, "zerorun.x.j": set()}
    assert _cycles(graph) == [] and _cycles(_packages(graph)) == [["zerorun.x", "zerorun.y"]]


# What each runtime subpackage may import from the rest of the runtime (its __init__ docstring says why);
# "core" is any module at runtime/'s top level but the engine.
RUNTIME_LAYERS = {
    "comm": set(),
    "offload": {"memory", "partition"},
    "optim": {"comm", "offload", "core"},
    "stage3": {"comm", "offload", "core"},
    "checkpoint": {"comm", "offload", "optim", "core"},
    "interop": {"optim"},
}
# Below every layer: the runtime the engines live in (context.py) and what it holds, which any subpackage may import
# and which import nothing else of the runtime.
FOUNDATION = {"context", "events", "ranges"}


def test_the_foundation_imports_nothing_else_of_the_runtime() -> None:
    graph = _graph()
    below = {f"zerorun.runtime.{name}" for name in FOUNDATION}
    assert {(m, t) for m in below for t in graph[m] if t.startswith("zerorun.runtime.") and t not in below} == set()


def test_runtime_subpackages_import_only_the_layers_below_them() -> None:
    wrong = []
    for module, targets in _graph().items():
        parts = module.split(".")
        if parts[:2] != ["zerorun", "runtime"] or len(parts) < 4:
            continue
        allowed = RUNTIME_LAYERS[parts[2]]
        for target in targets:
            tparts = target.split(".")
            if tparts[:2] != ["zerorun", "runtime"] or len(tparts) < 3 or tparts[2] == parts[2]:
                continue
            layer = tparts[2] if len(tparts) > 3 else tparts[2] if tparts[2] in allowed else "core"
            if len(tparts) == 3 and tparts[2] in FOUNDATION:
                continue
            if layer not in allowed or target == "zerorun.runtime.engine":
                wrong.append(f"{module} imports {target}")
    assert not wrong, "; ".join(wrong)
