"""`launch.deepspeed_compat`: make `import deepspeed` in the user's script resolve to zerorun's API.

The worker calls `install(args)` before it runs the script. `deepspeed` and its submodules that
zerorun provides (`deepspeed.accelerator`, `deepspeed.comm`, `deepspeed.zero`) become
`zerorun.compat.deepspeed[...]`, ahead of a real DeepSpeed installed in the same environment; any other `deepspeed.*` import fails
with a message naming it. As DeepSpeed's launcher does, the script gets `--local_rank=<local
rank>` before its own arguments unless `launch.deepspeed_local_rank` is false.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

from zerorun.config import Recipe

PACKAGE = "zerorun.compat.deepspeed"
PROVIDED = ("accelerator", "comm", "zero")


class _RefuseMissing(importlib.abc.MetaPathFinder):
    """Turns the import of a `deepspeed.*` module zerorun does not provide into an error that names it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("deepspeed.") and fullname not in sys.modules:
            raise ModuleNotFoundError(f"{fullname} is not provided by zerorun's DeepSpeed compatibility "
                                      f"(launch.deepspeed_compat); it provides deepspeed."
                                      f"{{{', '.join(PROVIDED)}}} and the functions of `deepspeed` itself.",
                                      name=fullname)
        return None


def install(recipe: Recipe, args: Sequence[str]) -> list[str]:
    """Register the shim as `deepspeed`; return the script's arguments (with --local_rank when asked)."""
    package = importlib.import_module(PACKAGE)
    sys.modules["deepspeed"] = package
    for name in PROVIDED:
        sys.modules[f"deepspeed.{name}"] = importlib.import_module(f"{PACKAGE}.{name}")
    if not any(isinstance(finder, _RefuseMissing) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RefuseMissing())
    args = list(args)
    if recipe.launch.deepspeed_local_rank and not any(a.startswith("--local_rank") for a in args):
        args.insert(0, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")  # where DeepSpeed's launcher puts it
    return args
