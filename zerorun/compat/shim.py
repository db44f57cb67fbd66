"""`launch.deepspeed_compat`: make `import deepspeed` in the user's script resolve to zerorun's API.

The worker calls `install(args)` before it runs the script. `deepspeed` and its submodules that
zerorun provides (`PROVIDED`) become `zerorun.compat.deepspeed[...]`, ahead of a real DeepSpeed
installed in the same environment; any other `deepspeed.*` import fails with a message naming it.
As DeepSpeed's launcher does, the script gets `--local_rank=<local rank>` before its own arguments
unless `launch.deepspeed_local_rank` is false.

transformers and accelerate decide whether DeepSpeed is there from the module spec and from the
installed distribution's metadata (`importlib.metadata.version("deepspeed")`, checked against their
minimum versions). The finder installed here answers both: the spec is the shim's, and the
distribution `deepspeed` has version `API_VERSION+zerorun.<zerorun's version>`: the DeepSpeed
release whose API the shim follows, marked as zerorun's (PEP 440 local version).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from zerorun.compat import hf_cpu
from zerorun.config import Recipe

PACKAGE = "zerorun.compat.deepspeed"
PROVIDED = ("accelerator", "comm", "zero", "utils", "ops", "ops.adam", "ops.adagrad", "ops.lion", "runtime", "runtime.lr_schedules",
            "runtime.engine", "runtime.zero", "runtime.zero.partition_parameters", "checkpoint", "checkpoint.utils")


class ShimDistribution(importlib.metadata.Distribution):
    """The `deepspeed` distribution metadata zerorun's shim stands for (no files of its own)."""

    def read_text(self, filename: str) -> str | None:
        from zerorun.compat.deepspeed import __version__

        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {__version__}\n"
                    "Summary: zerorun's DeepSpeed compatibility layer (zerorun.compat.deepspeed), not DeepSpeed\n"
                    "Author: zerorun\n")
        return None

    def locate_file(self, path: Any) -> Any:
        return os.path.join(os.path.dirname(importlib.import_module(PACKAGE).__file__ or ""), str(path))


class _Shim(importlib.abc.MetaPathFinder):
    """Refuses `deepspeed.*` modules zerorun does not provide, naming them; answers for the distribution."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.startswith("deepspeed.") and fullname not in sys.modules:
            raise ModuleNotFoundError(f"{fullname} is not provided by zerorun's DeepSpeed compatibility "
                                      f"(launch.deepspeed_compat); it provides deepspeed."
                                      f"{{{', '.join(PROVIDED)}}} and the functions of `deepspeed` itself.",
                                      name=fullname)
        return None

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()) -> Iterator[Any]:
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() == "deepspeed":
            yield ShimDistribution()


def install(recipe: Recipe, args: Sequence[str]) -> list[str]:
    """Register the shim as `deepspeed`; return the script's arguments (with --local_rank when asked)."""
    install_modules()
    args = list(args)
    if recipe.launch.deepspeed_local_rank and not any(a.startswith("--local_rank") for a in args):
        args.insert(0, f"--local_rank={os.environ.get('LOCAL_RANK', '0')}")  # where DeepSpeed's launcher puts it
    return args


def install_modules() -> None:
    """`deepspeed` and its PROVIDED submodules are the shim's from now on in this process (the zygote installs
    them before it imports a script's libraries, the rank again: nothing changes then)."""
    package = importlib.import_module(PACKAGE)
    # a snapshot, taken at once: another thread of this process (the telemetry probe's) may import while this loops
    for name in [n for n in list(sys.modules) if n == "deepspeed" or n.startswith("deepspeed.")]:
        if not getattr(sys.modules[name], "__name__", "").startswith(PACKAGE):
            del sys.modules[name]  # a real DeepSpeed imported earlier in this process: none of it may answer
    sys.modules["deepspeed"] = package
    for name in PROVIDED:
        sys.modules[f"deepspeed.{name}"] = importlib.import_module(f"{PACKAGE}.{name}")
    if not any(isinstance(finder, _Shim) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Shim())
    hf_cpu.install()  # accelerate's DeepSpeed mode and transformers' --bf16 on gloo CPU ranks
