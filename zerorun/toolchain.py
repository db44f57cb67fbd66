"""The tools a kernel build runs (the C++ compiler, the CUDA toolkit), checked before a build, and the
output of a failed build cut down to the lines that say why.

Where the CUDA toolkit is. torch.utils.cpp_extension decides CUDA_HOME once, at import: $CUDA_HOME or
$CUDA_PATH, else the folder above the `nvcc` on PATH, else /usr/local/cuda. When that `nvcc` is a
wrapper script (Debian's /usr/bin/nvcc, environment modules, ccache or site shims in
/usr/local/bin) the guess is the wrapper's folder: torch links with `-L/usr/local/lib64 -lcudart`
and the build ends in `cannot find -lcudart`. nvcc itself knows where it lives: run verbosely it
prints its environment, `#$ TOP=<toolkit root>` (what CMake reads to find the toolkit), so
`cuda_home()` asks it, and `torch_cuda_home()` makes torch build with that root.

Why a build failed. torch raises the whole ninja log; `first_error` keeps the first compiler or
linker diagnostics and, when the link failed, the link command itself: its `-L` folders show where
the linker looked (`collect2: error: ld returned 1 exit status` alone says nothing).
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import shutil
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch


class BuildError(Exception):
    """A kernel could not be built; the message is the reason, in one line."""


def cxx() -> str:
    return os.environ.get("CXX", "c++")


def cuda_home() -> str | None:
    """The CUDA toolkit's root: $CUDA_HOME or $CUDA_PATH, else where the `nvcc` on PATH says it lives,
    else torch's own guess (None on a CPU-only torch with neither)."""
    explicit = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if explicit:
        return explicit
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        root = _toolkit_root(nvcc, os.stat(nvcc).st_mtime_ns)
        if root is not None:
            return root
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME


@functools.lru_cache(maxsize=8)
def _toolkit_root(nvcc: str, mtime_ns: int) -> str | None:
    """`TOP` from nvcc's verbose dry run of an empty compilation (None when it prints none); `mtime_ns`
    keys the cache, so a replaced nvcc is asked again."""
    try:
        run = subprocess.run([nvcc, "-v", "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"^#\$ TOP=(.+)$", run.stdout + "\n" + run.stderr, re.MULTILINE)
    if found is None:
        return None
    root = Path(found.group(1).strip()).resolve()  # TOP is "<root>/bin/.."
    return str(root) if (root / "bin").is_dir() else None


@contextmanager
def torch_cuda_home(root: str | None) -> Iterator[None]:
    """torch.utils.cpp_extension builds with `root` as CUDA_HOME (its nvcc, its lib64) inside the block."""
    from torch.utils import cpp_extension

    saved = cpp_extension.CUDA_HOME
    cpp_extension.CUDA_HOME = root if root is not None else saved
    try:
        yield
    finally:
        cpp_extension.CUDA_HOME = saved


def preflight(cuda: bool) -> None:
    """Fail fast, with the fix, on what would otherwise be a long cascade of build errors."""
    from torch.utils import cpp_extension

    compiler = cxx()
    if shutil.which(shlex.split(compiler)[0] if compiler.strip() else "c++") is None:
        raise BuildError(f"no C++ compiler: `{compiler}` not found (install g++, or set CXX to one)")
    try:
        subprocess.run([*shlex.split(compiler), "--version"], capture_output=True, check=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"the C++ compiler `{compiler}` does not run ({exc})") from None
    if not cpp_extension.is_ninja_available():
        raise BuildError("ninja not found; torch.utils.cpp_extension needs it (pip install ninja)")
    if not cuda:
        return
    if torch.version.cuda is None:
        raise BuildError(f"torch {torch.__version__} is a CPU-only build")
    root = cuda_home()
    nvcc = Path(root or "/nonexistent") / "bin" / "nvcc"
    if not nvcc.is_file():
        raise BuildError(f"nvcc not found (CUDA_HOME={root}); install the CUDA {torch.version.cuda} toolkit "
                         "or set CUDA_HOME to it")
    try:
        banner = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BuildError(f"{nvcc} does not run: {exc}") from None
    found = re.search(r"release (\d+)\.(\d+)", banner)
    if found and found.group(1) != torch.version.cuda.split(".")[0]:
        raise BuildError(f"CUDA version mismatch: {nvcc} is CUDA {found.group(1)}.{found.group(2)} but torch was "
                         f"built with CUDA {torch.version.cuda}; set CUDA_HOME to a {torch.version.cuda} toolkit")


_DIAGNOSTIC = re.compile(r"\berror\b|cannot find|undefined reference|\bfatal\b", re.IGNORECASE)
_NOISE = ("Error building extension", "ninja: build stopped", "FAILED:")


def first_error(output: str) -> str:
    """'build failed: ' and the first two diagnostics of a failed build's output (else its last line);
    for a failed link, also the link command and, for a missing libcudart, the fix."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    diagnostics = [line for line in lines if _DIAGNOSTIC.search(line) and not line.startswith(_NOISE)]
    chosen = diagnostics[:2] or lines[-1:] or ["unknown error"]
    summary = "build failed: " + " | ".join(line[:300] for line in chosen)
    target, command = _failed_step(lines)
    if target.endswith((".so", ".dylib", ".pyd")) and command:
        summary += f" | link command: {command[:1000]}"
        if "cannot find -lcudart" in output:
            summary += (" | libcudart is not in the -L folders above: set CUDA_HOME to the CUDA toolkit's root "
                        "(the folder with bin/nvcc and lib64/)")
    return summary


def _failed_step(lines: list[str]) -> tuple[str, str]:
    """(target, command) of ninja's first `FAILED: target` step; ('', '') when there is none."""
    for i, line in enumerate(lines):
        if line.startswith("FAILED:"):
            return line.removeprefix("FAILED:").strip(), lines[i + 1] if i + 1 < len(lines) else ""
    return "", ""
