"""The runtime keeps no mutable state in its modules: what engines share lives in a `Runtime` (zerorun/runtime/context.py).

Two engines in one process (ranks as threads, a test and its reference) share only the runtime they were built in.
A list of listeners, a set of live engines or a switch kept in a module's globals would be shared by every engine
of the process, whatever runtime it lives in: the bug this file keeps out. Refused in zerorun/runtime/ and in
zerorun/__init__.py (the recipe a worker was launched with):

- a `global` statement (a function rebinding module state: a switch, a lazily made value);
- a module-level name in lower case bound to a mutable container (a list, dict or set, a `deque`, a weak set or
  dictionary, an `itertools.count`, a `threading.local`);
- a module-level constant (UPPER_CASE) that its module changes (`.append`, `[key] = ...`, `del NAME[...]`);
- a function cache at module level (`functools.cache`, `lru_cache`): state, process-wide.

What stays per process by nature is named in context.py's docstring (torch attributes an engine patches, whose
holders interop/patches.py counts; the kernels a process has loaded, zerorun/ops.py; the telemetry probe).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "zerorun"
CHECKED = sorted((PACKAGE / "runtime").rglob("*.py")) + [PACKAGE / "__init__.py"]

MUTABLE_CALLS = {"list", "dict", "set", "bytearray", "defaultdict", "deque", "OrderedDict", "Counter",
                 "WeakKeyDictionary", "WeakValueDictionary", "WeakSet", "count", "local", "Queue", "SimpleQueue"}
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "add", "discard", "update",
            "setdefault", "appendleft", "extendleft", "__setitem__", "__delitem__"}
CACHES = {"cache", "lru_cache", "cached_property"}


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in MUTABLE_CALLS
    return False


def _constant(name: str) -> bool:
    return name.strip("_").isupper() or (name.startswith("__") and name.endswith("__"))


def _module_names(tree: ast.Module) -> dict[str, ast.expr | None]:
    names: dict[str, ast.expr | None] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    names[target.id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node.value
    return names


def _changed(tree: ast.Module) -> set[str]:
    """Names the module changes in place: `NAME.append(...)`, `NAME[k] = ...`, `NAME[k] += ...`, `del NAME[k]`."""
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS \
                and isinstance(node.func.value, ast.Name):
            changed.add(node.func.value.id)
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Name):
                changed.add(target.value.id)
    return changed


def module_state(source: str, where: str) -> list[str]:
    """What of `source` (a module's text) is mutable module-level state, one line each."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            found.append(f"{where}:{node.lineno}: global {', '.join(node.names)}")
    names = _module_names(tree)
    changed = _changed(tree)
    for name, value in names.items():
        if not _constant(name) and _mutable(value):
            found.append(f"{where}: {name} is a mutable container at module level")
        elif _constant(name) and name in changed:
            found.append(f"{where}: {name} is a constant its module changes")
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
                if name in CACHES:
                    found.append(f"{where}:{node.lineno}: {node.name} caches its results for the process")
    return found


def test_the_runtime_keeps_no_mutable_state_in_its_modules() -> None:
    found = [line for path in CHECKED for line in module_state(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, ("module-level state in the runtime (keep it in a Runtime part, zerorun/runtime/context.py):\n"
                       + "\n".join(found))


def test_the_check_finds_each_kind_of_module_state() -> None:
    """Each rule on the shapes the runtime had (events' listener lists, the shared-memory segments by group, the live
    engines with their build counter, the ranges' switch), and what passes."""
    bad = textwrap.dedent("""
        import itertools, weakref, functools
        _listeners: list = []
        _live = weakref.WeakKeyDictionary()
        _built = itertools.count()
        _SHM: dict = {}
        _recording = False

        def record(on):
            global _recording
            _recording = on

        def segment(group, make):
            _SHM[group] = make()

        @functools.lru_cache(None)
        def probe():
            return 1
    """)
    assert [line.split(": ", 1)[1] for line in module_state(bad, "m.py")] == [
        "global _recording", "_listeners is a mutable container at module level",
        "_live is a mutable container at module level", "_built is a mutable container at module level",
        "_SHM is a constant its module changes", "probe caches its results for the process"]
    fine = textwrap.dedent("""
        __all__ = ["Runtime"]
        _ROUTES = {"a": 1}
        _OPS = list(range(3))

        class Runtime:
            def __init__(self):
                self.listeners = []

            def add(self, listener):
                self.listeners.append(listener)

        def lookup(key):
            table = {}
            table[key] = _ROUTES[key]
            return table
    """)
    assert module_state(fine, "m.py") == []
