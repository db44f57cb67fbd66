"""The heavy libraries a script imports, imported once by its node's zygote rather than by every rank.

A Hugging Face rank spends 4-5 s of CPU in `from transformers import Trainer` before its first line of
training (transformers, accelerate, and what they pull in: dynamo, DTensor, scipy). The ranks of a node
all pay it at the same moment. The zygote (`warm`) can pay it once and fork ranks that have it, as it does
for torch, if importing the library there leaves each rank exactly as importing it in the rank would. So
the zygote imports only what the script's leading imports take from `LIBRARIES`, and only under the
conditions the worker would import it under:

- **What the worker sets up before the script, first.** The DeepSpeed shim where the recipe asks for it
  (transformers and accelerate decide at import whether DeepSpeed is there), and the functions zerorun
  routes while a script runs (`interop.hold_for_script`: a library that binds `clip_grad_norm_` at import
  binds the routed one, as in the rank), held for the imports and released after.
- **The script's own statements, in its order, and only those that come before anything else runs.** The
  leading block of imports, up to the first other statement or import of a module of the user's
  (`script_imports`): a script that sets `HF_HUB_OFFLINE` before its `import transformers` gets its
  libraries imported in the rank. `import transformers.trainer_utils` imports that module;
  `from transformers import Trainer` reads `Trainer` from transformers, which is what imports
  `transformers.trainer`. A statement that fails stops the imports: the rank runs it again and shows
  its own traceback.
- **Refused, whole, where the result could differ.** The zygote forks nothing (each rank then starts as a
  fresh interpreter) when the imports asked torch about CUDA (a process forked after the CUDA driver was
  asked cannot use it), or left a thread running (a fork copies no thread).

Nothing else of the rank's differs at that point: the libraries here read no variable torchrun sets per
rank at import (`tests/launch/test_warm.py` records what they read), and the process group is joined in the
rank, after the fork, as before.
"""

from __future__ import annotations

import ast
import importlib
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

LIBRARIES = ("transformers", "accelerate")
Statement = tuple[str, tuple[str, ...]]  # a module, and the names the script reads from it (`from m import a, b`)


def script_imports(path: str) -> list[Statement]:
    """The imports from LIBRARIES in the script's leading block of imports, in its order; none where it cannot
    be read or parsed.

    The block ends at the first statement that is not an import, or that imports anything but the standard
    library, torch, numpy, zerorun and LIBRARIES: a line such as `os.environ["HF_HUB_OFFLINE"] = "1"`, a
    `sys.path` entry or a module of the user's may change what a library reads at its import, and the zygote
    runs none of them. So only what Python would import before anything of the script's own has run is
    imported early."""
    try:
        with open(path, "rb") as source:
            tree = ast.parse(source.read(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return []
    found: list[Statement] = []
    for index, node in enumerate(tree.body):
        if index == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            break
        if not all(_harmless(module) for module in modules):
            break
        if isinstance(node, ast.Import):
            found += [(module, ()) for module in modules if _ours(module)]
        elif _ours(modules[0]):
            found.append((modules[0], tuple(alias.name for alias in node.names if alias.name != "*")))
    return found


def _ours(module: str) -> bool:
    return module.split(".")[0] in LIBRARIES


def _harmless(module: str) -> bool:
    """Imported before a library's import without changing what it reads: the zygote need not run it first."""
    top = module.split(".")[0]
    return top in LIBRARIES or top in sys.stdlib_module_names or top in ("torch", "numpy", "zerorun")


def import_for(script: str, deepspeed_compat: bool) -> str | None:
    """Import what `script` imports from LIBRARIES, as its rank would. Returns why the zygote must not fork
    after that (it then forks nothing), or None."""
    statements = script_imports(script)
    if not statements:
        return None
    from zerorun.runtime import interop

    if deepspeed_compat:
        from zerorun.compat import shim

        shim.install_modules()
    release = interop.hold_for_script()
    here = os.path.dirname(os.path.abspath(script))
    sys.path.insert(0, here)  # as the worker puts it: a module beside the script named like a library is the one
    try:
        with _cuda_asked() as asked:
            _run(statements)
    finally:
        if here in sys.path:
            sys.path.remove(here)
        release()
    if asked:
        return f"importing {statements[0][0]} asked torch about CUDA ({', '.join(sorted(set(asked)))})"
    if threading.active_count() > 1:
        return f"importing {statements[0][0]} started a thread"
    return None


def _run(statements: list[Statement]) -> None:
    for module, names in statements:
        try:
            imported = importlib.import_module(module)
            for name in names:
                if not hasattr(imported, name):  # a submodule not imported yet, as `from m import sub` finds it
                    importlib.import_module(f"{module}.{name}")
        except BaseException:  # noqa: BLE001 - the rank runs the same statement and reports it
            return


@contextmanager
def _cuda_asked() -> Iterator[list[str]]:
    """Records, while held, every call that would reach the CUDA driver (each still made). The stand-ins are
    `AttributePatch`es: one a library replaced meanwhile stays the library's, as in a rank."""
    import torch

    from zerorun.runtime.interop.patches import AttributePatch

    asked: list[str] = []
    targets: list[tuple[Any, str]] = [(torch.cuda, name) for name in ("is_available", "device_count", "init",
                                                                      "current_device", "get_device_properties")]
    targets += [(torch._C, name) for name in ("_cuda_getDeviceCount", "_cuda_init") if hasattr(torch._C, name)]
    releases = [AttributePatch(owner, name, _recorder(name, asked)).hold() for owner, name in targets]
    try:
        yield asked
    finally:
        for release in releases:
            release()


def _recorder(name: str, asked: list[str]) -> Any:
    def wrap(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            asked.append(name)
            return original(*args, **kwargs)
        return call
    return wrap
