"""Building zerorun's kernels once per machine and caching them (ops.py loads what is built here).

The sources have no torch headers (they compile in seconds and expose a C ABI called through ctypes),
and are built with `torch.utils.cpp_extension.load` into `<cache>/<torch version>-<kind>-<hash>/`,
where the hash covers the sources, the flags, the compiler, the Python version and (for CUDA) the
target architectures, so any change rebuilds and nothing stale loads. `<cache>` is
`$ZERORUN_CACHE/kernels`, else `$TORCH_EXTENSIONS_DIR/zerorun`, else `~/.cache/zerorun/kernels`.

Ranks on one node. The first rank to need a kernel takes an exclusive `flock` on `<dir>/build.lock`
and builds; the others block on the lock, then find the `.so` (named by `<dir>/BUILT`, written
last) and load it. A build that fails writes its reason to `<dir>/FAILED`: for a minute, other ranks
reuse it instead of each failing again. The kernel releases a flock when its holder dies, so a killed
build blocks nobody. A build records how long it took (`<dir>/BUILD_S`): the next build of that kernel (a
new torch, new sources) announces it with that figure (`previous_build_s`).
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import logging
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from zerorun.toolchain import BuildError, cuda_home, cxx, first_error, preflight, torch_cuda_home

KINDS = ("cpu_adam", "fused_adam", "aio", "quantize", "quantize_cuda")
LOCK_TIMEOUT_S = 900.0  # a CUDA build on a busy node can take minutes; a hung one should not hang a job forever
FAILURE_REUSE_S = 60.0  # a failure this recent is another rank's of the same job: reuse it, do not rebuild
BUILD_SECONDS = "BUILD_S"  # in a build directory: how long its build took


class Obtained(enum.Enum):
    """How a process came by a kernel's library."""

    CACHED = "cached"  # built before: loaded at once
    BUILT = "built"  # compiled by this process now
    WAITED = "waited"  # another process of the node was building it: waited, then loaded


@dataclass(frozen=True)
class KernelSpec:
    kind: str
    source: str
    cuda: bool
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    headers: tuple[str, ...] = ("adam.h",)  # hashed with the source: a change rebuilds


# -fno-math-errno lets sqrtf vectorise (without it the loop runs at half speed); -fno-trapping-math lets GCC
# vectorise the selects of the fp16 conversions and of most Adam variants with a cast copy (without it they ran
# as scalar code); neither changes a result. No implicit fma contraction (adam.h places its fmas where
# torch has them); no -march=native: cpu_adam.cpp dispatches between its variants at run time, so the
# cache stays portable.
SPECS = {
    "cpu_adam": KernelSpec("cpu_adam", "cpu_adam.cpp", cuda=False,
                           cflags=("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"),
                           ldflags=("-fopenmp",)),
    "fused_adam": KernelSpec("fused_adam", "fused_adam.cu", cuda=True, cflags=("-O3",),
                             cuda_cflags=("-O3", "-std=c++17", "--fmad=false")),
    # asynchronous O_DIRECT reads/writes for the NVMe store (zerorun/runtime/offload/aio.py); raw syscalls, no libaio
    "aio": KernelSpec("aio", "aio.cpp", cuda=False, cflags=("-O2", "-pthread"), ldflags=("-pthread",), headers=()),
    # block int8 for qwZ/qgZ (zerorun/runtime/comm/quantize.py); the same bits as torch's path, in one sweep
    "quantize": KernelSpec("quantize", "quantize.cpp", cuda=False,
                           cflags=("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"), ldflags=("-fopenmp",)),
    # the same format and bits for CUDA tensors (qwZ/qgZ on NCCL)
    "quantize_cuda": KernelSpec("quantize_cuda", "quantize.cu", cuda=True, cflags=("-O3",),
                                cuda_cflags=("-O3", "-std=c++17", "--fmad=false")),
}


def sources_dir() -> Path:
    """Where the kernel sources are: `zerorun/kernels` in a wheel, `kernels/` in a checkout."""
    installed = Path(__file__).resolve().parent / "kernels"
    return installed if (installed / "adam.h").is_file() else Path(__file__).resolve().parents[1] / "kernels"


def cache_root() -> Path:
    if os.environ.get("ZERORUN_CACHE"):
        return Path(os.environ["ZERORUN_CACHE"]) / "kernels"
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "zerorun"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerorun" / "kernels"


def build_dir(kind: str) -> Path:
    """The cache directory of one kernel for this machine, torch, compiler and source."""
    spec = SPECS[kind]
    digest = hashlib.sha256()
    for name in (*spec.headers, spec.source):
        digest.update(name.encode() + b"\0" + (sources_dir() / name).read_bytes())
    key = [spec, cxx(), platform.machine(), sys.version_info[:2], torch.__version__]
    if spec.cuda:
        key += [os.environ.get("TORCH_CUDA_ARCH_LIST"), cuda_home(), _cuda_capabilities()]
    digest.update(repr(key).encode())
    return cache_root() / f"{torch.__version__}-{kind}-{digest.hexdigest()[:16]}"


def _cuda_capabilities() -> list[tuple[int, int]]:
    if not torch.cuda.is_available():
        return []
    return sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})


@contextmanager
def _file_lock(path: Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive flock on `path`: held by one process of the node, released if it dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"waited {timeout:.0f} s for another process building in {path.parent}; "
                                     f"remove {path} if no build is running") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def built_library(directory: Path) -> Path | None:
    """The built library named by `<dir>/BUILT` (written last, atomically), if there is one."""
    built = directory / "BUILT"
    if not built.is_file():
        return None
    library = directory / built.read_text().strip()
    return library if library.is_file() else None


def _compile(spec: KernelSpec, directory: Path) -> Path:
    """Run torch.utils.cpp_extension quietly; the library's path, or BuildError with the first error line."""
    from torch.utils import cpp_extension

    preflight(spec.cuda)
    (directory / "lock").unlink(missing_ok=True)  # torch's own baton, left behind by a killed build; we hold ours
    name = f"zerorun_{spec.kind}"
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), torch_cuda_home(cuda_home() if spec.cuda else None):
            warnings.simplefilter("ignore")
            cpp_extension.load(name=name, sources=[str(sources_dir() / spec.source)], extra_cflags=list(spec.cflags),
                               extra_cuda_cflags=list(spec.cuda_cflags), extra_ldflags=list(spec.ldflags),
                               extra_include_paths=[str(sources_dir())], build_directory=str(directory),
                               verbose=False, with_cuda=spec.cuda, is_python_module=False)
    except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/OSError/...; all mean "did not build"
        log = directory / "build.log"
        log.write_text(f"{type(exc).__name__}: {exc}\n")
        raise BuildError(f"{first_error(str(exc))} (full log: {log})") from None
    finally:
        torch_log.setLevel(level)
    # torch renames to name_v1, ... when one process builds a name twice with different arguments
    library = max(directory.glob(f"{name}*.so"), key=lambda p: p.stat().st_mtime)
    _write_atomically(directory / "BUILT", library.name)
    return library


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    os.replace(temporary, path)


def previous_build_s(kind: str) -> float | None:
    """How long the latest recorded build of `kind` took on this machine (any torch, any sources), if any."""
    records = sorted(cache_root().glob(f"*-{kind}-*/{BUILD_SECONDS}"), key=lambda p: p.stat().st_mtime)
    for record in reversed(records):
        try:
            return float(record.read_text())
        except (OSError, ValueError):
            continue
    return None


def build_or_wait(kind: str, retry_failed: bool, on_build: Callable[[float | None], None] = lambda before: None
                  ) -> tuple[Path, Obtained]:
    """(library path, how it was obtained). One process of the node builds, after calling `on_build` with how long
    the previous build of the kernel took (None: no record); the others wait and load."""
    directory = build_dir(kind)
    library = built_library(directory)
    if library is not None:
        return library, Obtained.CACHED
    directory.mkdir(parents=True, exist_ok=True)
    with _file_lock(directory / "build.lock"):
        library = built_library(directory)
        if library is not None:
            return library, Obtained.WAITED
        failed = directory / "FAILED"
        if failed.is_file() and not retry_failed and time.time() - failed.stat().st_mtime < FAILURE_REUSE_S:
            raise BuildError(failed.read_text().strip())  # another rank of this job just failed: do not fail again
        on_build(previous_build_s(kind))
        started = time.monotonic()
        try:
            library = _compile(SPECS[kind], directory)
        except BuildError as exc:
            _write_atomically(failed, str(exc))
            raise
        _write_atomically(directory / BUILD_SECONDS, f"{time.monotonic() - started:.1f}")
        failed.unlink(missing_ok=True)
        return library, Obtained.BUILT
