"""The repository stays clean: no large files or build artefacts tracked by accident, no package left out of the wheel.

A 10.6 MB wheel once sat at the root, used by nothing, 11 of the repository's 14 MB. Large files belong
outside the repository unless they are data an example trains on (named below).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
MAX_BYTES = 2**20
DATA = {"recipes/data/shakespeare.txt"}  # the real-text example's corpus (docs/recipes.md)


def _tracked() -> list[str]:
    done = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        pytest.skip("not a git checkout")
    return done.stdout.splitlines()


def test_no_tracked_file_is_over_1_mib_but_the_named_data_files() -> None:
    large = [f"{path} ({(ROOT / path).stat().st_size / 2**20:.1f} MiB)" for path in _tracked()
             if (ROOT / path).is_file() and (ROOT / path).stat().st_size > MAX_BYTES and path not in DATA]
    assert not large, f"tracked files over 1 MiB: {large}; keep them out of git, or name them in DATA with why"


def test_no_build_artefact_is_tracked() -> None:
    suffixes = (".whl", ".so", ".o", ".pyc", ".egg", ".tar.gz")
    assert not [path for path in _tracked() if path.endswith(suffixes)]


def test_the_package_list_is_every_package_on_disk() -> None:
    """setuptools' `packages.find` cannot ship `kernels/` (sources at the repository's root, outside the package
    tree) as zerorun.kernels, so pyproject.toml lists the packages; this keeps the list equal to what is on disk,
    so a new subpackage cannot be left out of the wheel."""
    from setuptools import find_packages

    listed = re.search(r"^packages = (\[.*?\])", (ROOT / "pyproject.toml").read_text(), re.S | re.M)
    assert listed, "pyproject.toml: [tool.setuptools] packages = [...]"
    found = set(find_packages(str(ROOT), include=["zerorun", "zerorun.*"])) | {"zerorun.kernels"}
    assert set(ast.literal_eval(listed.group(1))) == found


def test_ruff_finds_nothing() -> None:
    """The lint CI runs ([tool.ruff.lint] in pyproject.toml: pyflakes, syntax errors, sorted imports)."""
    import shutil
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).is_file():
        pytest.skip("ruff is not installed (pip install '.[test]')")
    done = subprocess.run([ruff, "check", "zerorun", "tests", "recipes"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]


MAX_LINES = 450


def test_no_module_of_the_package_is_over_450_lines() -> None:
    """A module past ~450 lines has usually grown a second concern: split it where the concerns part (as
    checkpoint/tools.py left files.py, telemetry/whereabouts.py left probe.py)."""
    long = {str(path.relative_to(ROOT)): n for path in sorted((ROOT / "zerorun").rglob("*.py"))
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _private_names(tree: ast.Module) -> set[str]:
    """The private names a module defines: its functions, classes and globals, and the attributes its classes
    set on `self`."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id == "self"):
            names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_no_module_reads_another_modules_private_names() -> None:
    """A module of zerorun may use what another module defines only through its public names: a private one
    (`ops._load`, `scheduler._inside`) is an implementation detail its owner may change. torch's own private
    names (`torch._foreach_norm`, a compiled module's `_orig_mod`) are torch's business, not this rule's."""
    import torch

    torch_objects = (torch, torch.nn.Module(), torch.empty(0))
    trees = {path: ast.parse(path.read_text()) for path in sorted((ROOT / "zerorun").rglob("*.py"))}
    defined = {path: _private_names(tree) for path, tree in trees.items()}
    crossing = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls", "super"):
                continue
            if any(hasattr(torch_object, node.attr) for torch_object in torch_objects):
                continue  # torch's own (`module._buffers`), though a zerorun module has a name like it
            owners = [other for other, names in defined.items() if node.attr in names]
            if owners and path not in owners:
                crossing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)} "
                                f"(private to {', '.join(str(o.relative_to(ROOT)) for o in owners)})")
    assert not crossing, "\n".join(crossing)


STORES = ("zerorun/runtime/flat_params.py", "zerorun/runtime/stage3/sharded_params.py",
          "zerorun/runtime/stage3/scheduled_params.py")


def _does_nothing(function: ast.FunctionDef) -> bool:
    """A body of `pass`, `...`, a docstring, or `return` of a constant: a method there only to fill a Protocol."""
    body = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    return all(isinstance(s, ast.Pass) or (isinstance(s, ast.Return) and (s.value is None or isinstance(s.value, ast.Constant)))
               for s in body)


def test_no_parameter_store_has_a_method_that_does_nothing() -> None:
    """Where the stores differ the Protocol is split (store.py's `UnitPasses` is stage 3's alone), rather than one
    store filling a wide Protocol with methods that do nothing (stages 0-2's store had five)."""
    empty = [f"{path}: {node.name}" for path in STORES
             for node in ast.walk(ast.parse((ROOT / path).read_text()))
             if isinstance(node, ast.FunctionDef) and _does_nothing(node)]
    assert not empty, empty


TENSOR_COLLECTIVES = {"all_reduce", "broadcast", "reduce_scatter_tensor", "all_gather_into_tensor", "all_to_all_single",
                      "reduce_scatter", "all_gather", "isend", "irecv", "send", "recv", "reduce", "gather", "scatter"}


def test_every_module_that_moves_tensors_through_torch_distributed_asks_the_wire_table() -> None:
    """What each backend carries (NCCL: device memory only; gloo's point to point: host memory only) is one table,
    runtime/comm/wire.py. A module that calls a tensor collective of torch.distributed itself, outside
    runtime/comm/ (which is built on the table) and the benchmarks (which time the backend's own on purpose),
    must consult it: compat/staged_params.py did not, and two GPUs over NCCL failed there while every CPU test
    passed."""
    unchecked = []
    for path in sorted((ROOT / "zerorun").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith(("zerorun/runtime/comm/", "zerorun/bench/")):
            continue
        tree = ast.parse(path.read_text())
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                 and node.func.attr in TENSOR_COLLECTIVES and ast.unparse(node.func.value) in ("dist", "torch.distributed")]
        uses_wire = any(isinstance(node, ast.ImportFrom) and node.module == "zerorun.runtime.comm.wire"
                        for node in ast.walk(tree))
        if calls and not uses_wire:
            unchecked += [f"{relative}:{call.lineno}: {ast.unparse(call.func)}" for call in calls]
    assert not unchecked, "\n".join(unchecked)
