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
    assert "zerorun.runtime.checkpoint" in graph["zerorun.runtime.engine"]  # imported inside a method
    assert "zerorun.runtime.engine" in graph["zerorun"]  # imported under TYPE_CHECKING and lazily


def _all_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    return _cycles(graph) + _cycles(_packages(graph))


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
