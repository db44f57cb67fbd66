"""`zerorun env`: what a bug report needs to know about this machine, in one table (or JSON).

`collect()` never raises for a missing piece: a tool that is absent or broken is reported as such,
because the report is most useful exactly on a machine where something is wrong.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from typing import Any, Callable

import zerorun

Report = dict[str, dict[str, Any]]


def collect() -> Report:
    """The report: sections of name -> value, in display order."""
    return {
        "zerorun": {"version": zerorun.__version__, "location": os.path.dirname(zerorun.__file__)},
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "system": _system(),
        "torch": _torch(),
        "distributed": _distributed(),
        "compilers": {name: _tool_version(name, flag) for name, flag in
                      (("gcc", "--version"), ("g++", "--version"), ("nvcc", "--version"), ("ninja", "--version"))},
        "kernels": _kernels(),
        "deepspeed compatibility": _deepspeed_compat(),
    }


def _deepspeed_compat() -> dict[str, Any]:
    """What `import deepspeed` gives a launched script: zerorun's shim, and the libraries that reach it."""
    from importlib import metadata

    from zerorun.compat.deepspeed import __version__ as shim_version

    def installed(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"shim": f"deepspeed {shim_version}: zerorun's shim (zerorun.compat.deepspeed), not DeepSpeed; "
                    "scripts get it under `zerorun launch script.py` or launch.deepspeed_compat",
            "real deepspeed": installed("deepspeed"), "transformers": installed("transformers"),
            "accelerate": installed("accelerate")}


def _system() -> dict[str, Any]:
    import psutil

    memory = psutil.virtual_memory()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "cpus usable": usable,
            "memory": f"{_gib(memory.total)} total, {_gib(memory.available)} available"}


def _torch() -> dict[str, Any]:
    try:
        import torch
    except ImportError as exc:
        return {"version": f"not importable ({exc})"}
    info: dict[str, Any] = {"version": torch.__version__, "cuda available": torch.cuda.is_available(),
                            "cuda version": torch.version.cuda}
    if torch.cuda.is_available():
        devices = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(f"{index}: {props.name}, {_gib(props.total_memory)}")
        info["cuda devices"] = devices
    return info


def _distributed() -> dict[str, Any]:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        return {"available": False}
    info: dict[str, Any] = {"available": dist.is_available()}
    if not dist.is_available():
        return info
    info["gloo"] = dist.is_gloo_available()
    info["mpi"] = dist.is_mpi_available()
    info["nccl"] = _nccl_version() if torch.cuda.is_available() else "n/a (no CUDA)"
    # zerorun never needs it on PATH: each node runs torchrun's main through `python -m zerorun.launch.torchrun`
    info["torchrun"] = shutil.which("torchrun") or f"not on PATH (zerorun runs `{sys.executable} -m zerorun.launch.torchrun`)"
    return info


def _nccl_version() -> str:
    try:
        import torch

        version = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001 - a report, not a check: say what went wrong
        return f"unavailable ({exc})"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _tool_version(name: str, flag: str) -> str:
    """`path (version)` of a command-line tool, or 'not found'."""
    path = shutil.which(name)
    if path is None:
        return "not found"
    try:
        result = subprocess.run([path, flag], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{path} (does not run: {exc})"
    text = result.stdout or result.stderr
    release = re.search(r"release [\d.]+[^\n]*", text)  # nvcc puts its version on the last line
    line = release.group(0) if release else (text.strip().splitlines() or ["?"])[0]
    return f"{path} ({line.strip()})"


def _kernels() -> dict[str, str]:
    """Per kernel: loaded / built / not built yet / failed (why) / unavailable (why). Builds nothing."""
    try:
        from zerorun import ops
    except Exception as exc:  # noqa: BLE001 - a module that fails to import is worth reporting as is
        return {"status": f"not built (importing zerorun.ops failed: {exc})"}
    try:
        return {**ops.status(), "aio backend": ops.aio_backend()}
    except Exception as exc:  # noqa: BLE001 - a broken build is exactly what the report must show
        return {"status": f"error: {exc}"}


def build_kernels(progress: Callable[[str], None]) -> list[str]:
    """Build every kernel this machine can have (`zerorun env --build`); the kinds that failed."""
    from zerorun import ops

    failed = []
    for kind in ops.KINDS:
        line = ops.build([kind])[kind]
        progress(f"{kind}: {line}")
        if line.startswith("failed"):
            failed.append(kind)
    return failed


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def rows(report: Report) -> list[tuple[str, str]]:
    """The report flattened to (`section.name`, text) rows."""
    out = []
    for section, items in report.items():
        for name, value in items.items():
            text = "\n".join(value) if isinstance(value, list) else ("-" if value is None else str(value))
            out.append((f"{section} {name}" if name not in ("version", "status") else section, text or "-"))
    return out


def print_table(report: Report) -> None:
    """Print the report as a two-column rich table."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"zerorun {report['zerorun']['version']} environment", show_header=False)
    table.add_column(style="bold")
    table.add_column(overflow="fold")
    for name, text in rows(report):
        table.add_row(name, text)
    Console().print(table)
