"""The launch and telemetry packages import one way: no module cycle, and telemetry never imports launch.

Every import is counted, at module level or inside a function (a lazy import still ties two modules
together). The whole-package check of issue 16 covers the runtime too; this one holds the launch side.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "zerorun"


def import_graph() -> dict[str, set[str]]:
    """zerorun module -> the zerorun modules it imports (a package's `__init__` is the package)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {dep for dep in found if dep in modules and dep != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_touches_launch_or_telemetry():
    ours = ("zerorun.launch", "zerorun.telemetry", "zerorun.offload_files")
    assert [c for c in cycles(import_graph()) if any(m.startswith(ours) for m in c)] == []


def test_telemetry_does_not_import_launch():
    graph = import_graph()
    assert {(m, d) for m, deps in graph.items() if m.startswith("zerorun.telemetry")
            for d in deps if d.startswith("zerorun.launch")} == set()


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
