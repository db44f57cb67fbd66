"""zerorun's kernels (`kernels/`): built once per machine, loaded by every rank, honest fallbacks.

`adamw_step` updates one flat fp32 shard in place. It runs our kernel for the tensors' device
(`cpu_adam` on CPU, `fused_adam` on CUDA) when that kernel is built or can be built now, else
torch's fused Adam(W) with the same numerics, after one warning that says why. `aio_library` is the
asynchronous O_DIRECT reader/writer behind the NVMe store (`zerorun/runtime/offload/aio.py` wraps it; its
fallback is a Python thread pool). `quantize_blocks` / `dequantize_blocks` are the block int8 codec of
qwZ and qgZ (`zerorun/runtime/comm/quantize.py` calls them; its fallback is torch, with the same bits).

Build and cache. The sources have no torch headers (they compile in seconds and expose a C ABI
called through ctypes), and are built with `torch.utils.cpp_extension.load` into
`<cache>/<torch version>-<kind>-<hash>/`, where the hash covers the sources, the flags, the
compiler, the Python version and (for CUDA) the target architectures, so any change rebuilds and
nothing stale loads. `<cache>` is `$ZERORUN_CACHE/kernels`, else `$TORCH_EXTENSIONS_DIR/zerorun`,
else `~/.cache/zerorun/kernels`. The CPU kernel is compiled for AVX2+FMA and baseline x86-64 and
picks at run time, so one cache can be shared by different machines (an NFS home).

Ranks on one node. The first rank to need a kernel takes an exclusive `flock` on `<dir>/build.lock`
and builds; the others block on the lock, then find the `.so` (named by `<dir>/BUILT`, written
last) and load it. A build that fails writes its reason to `<dir>/FAILED`: for a minute, other ranks
reuse it instead of each failing again; after that a new process (at once: `zerorun env --build`)
tries again. The kernel releases a flock when its holder dies, so a killed build blocks nobody.

`ZERORUN_KERNELS=off` skips our kernels (torch's fused Adam, no warning). The checks before a build,
where the CUDA toolkit is (asked of nvcc, not guessed from PATH) and the summary of a failed build
are in `zerorun/toolchain.py`.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from zerorun.toolchain import BuildError, cuda_home, cxx, first_error, preflight, torch_cuda_home

_cuda_home = cuda_home  # the name `zerorun bench gpu` reports

KINDS = ("cpu_adam", "fused_adam", "aio", "quantize", "quantize_cuda")
LOCK_TIMEOUT_S = 900.0  # a CUDA build on a busy node can take minutes; a hung one should not hang a job forever
FAILURE_REUSE_S = 60.0  # a failure this recent is another rank's of the same job: reuse it, do not rebuild
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class KernelWarning(UserWarning):
    """A zerorun kernel is unavailable and a fallback (torch's Adam, Python I/O threads) runs instead."""


@dataclass(frozen=True)
class KernelSpec:
    kind: str
    source: str
    cuda: bool
    cflags: tuple[str, ...]
    cuda_cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    headers: tuple[str, ...] = ("adam.h",)  # hashed with the source: a change rebuilds


# -fno-math-errno lets sqrtf vectorise (without it the loop runs at half speed); no implicit fma
# contraction (adam.h places its fmas where torch has them); no -march=native:
# cpu_adam.cpp dispatches between AVX2+FMA and baseline at run time, so the cache stays portable.
SPECS = {
    "cpu_adam": KernelSpec("cpu_adam", "cpu_adam.cpp", cuda=False,
                           cflags=("-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"), ldflags=("-fopenmp",)),
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


# ---- per process: what is loaded, what is not and why ----

@dataclass
class _Loaded:
    lib: ctypes.CDLL | None
    reason: str  # why lib is None ("" when loaded)
    unavailable: bool = False  # nothing to build here (no CUDA device, disabled): not a failure


_loaded: dict[str, _Loaded] = {}
_warned: set[str] = set()
_process_lock = threading.Lock()


def _disabled() -> bool:
    return os.environ.get("ZERORUN_KERNELS", "").lower() in ("0", "off", "false", "no", "torch")


def _unavailable_reason(kind: str) -> str | None:
    """Why this kernel cannot exist here at all (not an error)."""
    if _disabled():
        return f"disabled (ZERORUN_KERNELS={os.environ['ZERORUN_KERNELS']})"
    if SPECS[kind].cuda and not torch.cuda.is_available():
        return "no CUDA device"
    if kind == "aio" and not sys.platform.startswith("linux"):
        return "Linux only"
    return None


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


def _library(directory: Path) -> Path | None:
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


def _build_or_wait(kind: str, retry_failed: bool) -> tuple[Path, bool]:
    """(library path, compiled by this process). One process of the node builds; the others wait and load."""
    directory = build_dir(kind)
    library = _library(directory)
    if library is not None:
        return library, False
    directory.mkdir(parents=True, exist_ok=True)
    with _file_lock(directory / "build.lock"):
        library = _library(directory)
        if library is not None:
            return library, False
        failed = directory / "FAILED"
        if failed.is_file() and not retry_failed and time.time() - failed.stat().st_mtime < FAILURE_REUSE_S:
            raise BuildError(failed.read_text().strip())  # another rank of this job just failed: do not fail again
        try:
            library = _compile(SPECS[kind], directory)
        except BuildError as exc:
            _write_atomically(failed, str(exc))
            raise
        failed.unlink(missing_ok=True)
        return library, True


def _open(kind: str, library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))
    pointer, i32, i64, f64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_double
    if kind == "cpu_adam":
        lib.zr_cpu_adam.argtypes = [pointer, pointer, i32, pointer, pointer, pointer, i32, i64, i64, f64, f64, f64,
                                    f64, f64, i32, f64, i32]
        lib.zr_cpu_adam.restype = i32
        lib.zr_cpu_adam_use_isa.argtypes = [i32]
        lib.zr_cpu_adam_use_isa.restype = i32
        lib.zr_cpu_adam_isa.restype = i32
        lib.zr_cpu_adam_isa_name.argtypes = [i32]
        lib.zr_cpu_adam_isa_name.restype = ctypes.c_char_p
    elif kind == "quantize":
        lib.zr_quantize.argtypes = [pointer, i32, i64, i64, pointer, pointer, i32]
        lib.zr_dequantize.argtypes = [pointer, pointer, i64, i64, pointer, i32, i32, i32]
        lib.zr_quantize.restype = lib.zr_dequantize.restype = lib.zr_quantize_use_isa.restype = i32
        lib.zr_quantize_use_isa.argtypes = [i32]
        lib.zr_quantize_isa_name.restype = ctypes.c_char_p
    elif kind == "aio":
        text = ctypes.c_char_p
        for name, args, result in (("zr_aio_create", [i32, i32, i32, i64, text, i32], pointer),
                                   ("zr_aio_backend", [pointer], i32), ("zr_aio_backend_name", [i32], text),
                                   ("zr_aio_submit", [pointer, i32, pointer, i64, i64, i32], i64),
                                   ("zr_aio_wait", [pointer, i64, ctypes.POINTER(i64), text, i32], i32),
                                   ("zr_aio_poll", [pointer, i64], i32), ("zr_aio_destroy", [pointer], None)):
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    elif kind == "quantize_cuda":
        lib.zr_cuda_quantize.argtypes = [pointer, i32, i64, i64, pointer, pointer, pointer]
        lib.zr_cuda_dequantize.argtypes = [pointer, pointer, i64, i64, pointer, i32, i32, pointer]
        lib.zr_cuda_quantize.restype = lib.zr_cuda_dequantize.restype = i32
        lib.zr_cuda_quantize_error_string.argtypes = [i32]
        lib.zr_cuda_quantize_error_string.restype = ctypes.c_char_p
    else:
        lib.zr_cuda_adam.argtypes = [pointer, pointer, i32, pointer, pointer, pointer, i32, i64, i64, f64, f64, f64,
                                     f64, f64, i32, f64, pointer]
        lib.zr_cuda_adam.restype = i32
        lib.zr_cuda_error_string.argtypes = [i32]
        lib.zr_cuda_error_string.restype = ctypes.c_char_p
    return lib


def _load(kind: str, retry_failed: bool = False) -> _Loaded:
    """This process's handle on a kernel: loaded from the cache, built now, or the reason it is not."""
    with _process_lock:
        state = _loaded.get(kind)
        if state is not None and (state.lib is not None or not retry_failed):
            return state
        reason = _unavailable_reason(kind)
        if reason is not None:
            state = _Loaded(None, reason, unavailable=True)
        else:
            try:
                library, _ = _build_or_wait(kind, retry_failed)
            except BuildError as exc:
                state = _Loaded(None, str(exc))
            else:
                try:
                    state = _Loaded(_open(kind, library), "")
                except (OSError, AttributeError) as exc:  # a damaged cache entry: say how to rebuild it
                    state = _Loaded(None, f"cannot load {library} ({exc}); delete {library.parent} to rebuild")
        _loaded[kind] = state
        return state


_FALLBACKS = {  # what runs instead of each kernel, for the one warning per process
    "cpu_adam": "Adam runs on torch's fused implementation instead (same results; a low-precision copy takes a "
                "second pass)",
    "fused_adam": "Adam runs on torch's fused implementation instead (same results; a low-precision copy takes a "
                  "second pass)",
    "aio": "NVMe offload I/O runs on a Python thread pool instead (same results, more CPU per byte)",
    "quantize_cuda": "block int8 (qwZ/qgZ) of CUDA tensors runs on torch's operations instead (the same bits, "
                     "several passes over device memory)",
    "quantize": "block int8 (qwZ/qgZ) runs on torch instead (the same bits, several passes over memory where the "
                "kernel makes one)",
}


def _kernel(kind: str) -> ctypes.CDLL | None:
    """The loaded kernel, or None after warning once (per process) what runs instead and why."""
    state = _load(kind)
    if state.lib is None and not state.unavailable and kind not in _warned:
        _warned.add(kind)
        warnings.warn(f"zerorun: the {kind} kernel is unavailable ({state.reason}); {_FALLBACKS[kind]}. "
                      "`zerorun env --build` retries and shows the status.", KernelWarning, stacklevel=3)
    return state.lib


# ---- the public interface ----

def prepare(kind: str) -> bool:
    """Load (building it if need be) a kernel now, where a job sets up, rather than at its first use in a
    step; whether it is there. Where it is not, the one warning that says what runs instead comes now."""
    return _kernel(kind) is not None


def adamw_step(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
               decoupled: bool = True, grad_divisor: float = 1.0, lowp_out: torch.Tensor | None = None) -> None:
    """One Adam(W) update of flat fp32 tensors in place (params = fp32 master).

    grads may be fp32, bf16 or fp16 and are divided by `grad_divisor` in the same pass; their
    contents afterwards are unspecified (torch's fallback divides them in place). If `lowp_out`
    (bf16/fp16, same numel) is given, the updated params are also written there, cast. Our kernel
    runs when built (CPU or CUDA by device), else torch's fused Adam(W) with the same numerics.
    """
    _check(params, grads, exp_avg, exp_avg_sq, lowp_out)
    if params.numel() == 0:
        return
    hyper = (int(step), float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), int(decoupled),
             float(grad_divisor))
    kind = {"cpu": "cpu_adam", "cuda": "fused_adam"}.get(params.device.type)
    lib = _kernel(kind) if kind is not None else None
    if lib is None:
        _torch_adamw_step(params, grads, exp_avg, exp_avg_sq, *hyper, lowp_out)
        return
    lowp_ptr, lowp_code = (lowp_out.data_ptr(), _DTYPE_CODES[lowp_out.dtype]) if lowp_out is not None else (None, -1)
    args = (params.data_ptr(), grads.data_ptr(), _DTYPE_CODES[grads.dtype], exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
            lowp_ptr, lowp_code, params.numel(), *hyper)
    if kind == "cpu_adam":
        code = lib.zr_cpu_adam(*args, torch.get_num_threads())
        assert code == 0, f"zr_cpu_adam rejected its arguments (code {code})"
    else:
        with torch.cuda.device(params.device):
            code = lib.zr_cuda_adam(*args, torch.cuda.current_stream(params.device).cuda_stream)
        if code != 0:
            raise RuntimeError(f"zerorun fused_adam kernel launch failed: {lib.zr_cuda_error_string(code).decode()}")


def _check(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
           lowp_out: torch.Tensor | None) -> None:
    named = {"params": params, "grads": grads, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
    if lowp_out is not None:
        named["lowp_out"] = lowp_out
    for name, tensor in named.items():
        if not tensor.is_contiguous() or tensor.numel() != params.numel() or tensor.device != params.device:
            raise ValueError(f"adamw_step: {name} must be contiguous, on {params.device}, with {params.numel()} "
                             f"elements; got {tuple(tensor.shape)} on {tensor.device}")
    for name in ("params", "exp_avg", "exp_avg_sq"):
        if named[name].dtype != torch.float32:
            raise ValueError(f"adamw_step: {name} must be float32, got {named[name].dtype}")
    if grads.dtype not in _DTYPE_CODES:
        raise ValueError(f"adamw_step: grads must be float32, bfloat16 or float16, got {grads.dtype}")
    if lowp_out is not None and lowp_out.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"adamw_step: lowp_out must be bfloat16 or float16, got {lowp_out.dtype}")


def _torch_adamw_step(params: torch.Tensor, grads: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                      step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                      decoupled: int, grad_divisor: float, lowp_out: torch.Tensor | None) -> None:
    """The fallback: torch's fused Adam(W) (grad_scale = divisor), then a cast copy."""
    fused = torch._fused_adamw_ if decoupled else torch._fused_adam_
    grads = grads if grads.dtype == torch.float32 else grads.float()
    device = params.device
    divisor = None if grad_divisor == 1.0 else torch.full((), grad_divisor, dtype=torch.float32, device=device)
    fused([params], [grads], [exp_avg], [exp_avg_sq], [], [torch.full((), float(step), device=device)], lr=lr,
          beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
          grad_scale=divisor, found_inf=None)
    if lowp_out is not None:
        lowp_out.copy_(params)


def quantize_blocks(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor, block: int) -> bool:
    """Block int8 of `x` (contiguous fp32/bf16/fp16, on the CPU or a CUDA device) into `values` (int8, at least
    ceil(n / block) * block, the padding zeroed) and `scales` (fp32, one per block), in one sweep (on CUDA, on
    the current stream). False, having written nothing, where the kernel is not here: the caller runs torch's
    path (same bits)."""
    lib = _codec(x) if x.dtype in _DTYPE_CODES and x.is_contiguous() else None
    if lib is None:
        return False
    if x.device.type == "cuda":
        with torch.cuda.device(x.device):
            code = lib.zr_cuda_quantize(x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(), block, values.data_ptr(),
                                        scales.data_ptr(), torch.cuda.current_stream(x.device).cuda_stream)
        _check_cuda(lib, code, "zr_cuda_quantize")
        return True
    code = lib.zr_quantize(x.data_ptr(), _DTYPE_CODES[x.dtype], x.numel(), block, values.data_ptr(),
                           scales.data_ptr(), torch.get_num_threads())
    assert code == 0, f"zr_quantize rejected its arguments (code {code})"
    return True


def dequantize_blocks(values: torch.Tensor, scales: torch.Tensor, out: torch.Tensor, block: int,
                      accumulate: bool = False) -> bool:
    """`out` (contiguous, on the CPU or a CUDA device) = the block int8 `values` times their `scales`, or += them
    when `accumulate` (fp32 `out` only); one sweep. False, having written nothing, where the kernel is not
    here: the caller runs torch's path (same bits)."""
    usable = out.dtype in _DTYPE_CODES and out.is_contiguous() and (out.dtype == torch.float32 or not accumulate)
    lib = _codec(out) if usable else None
    if lib is None:
        return False
    if out.device.type == "cuda":
        with torch.cuda.device(out.device):
            code = lib.zr_cuda_dequantize(values.data_ptr(), scales.data_ptr(), out.numel(), block, out.data_ptr(),
                                          _DTYPE_CODES[out.dtype], int(accumulate),
                                          torch.cuda.current_stream(out.device).cuda_stream)
        _check_cuda(lib, code, "zr_cuda_dequantize")
        return True
    code = lib.zr_dequantize(values.data_ptr(), scales.data_ptr(), out.numel(), block, out.data_ptr(),
                             _DTYPE_CODES[out.dtype], int(accumulate), torch.get_num_threads())
    assert code == 0, f"zr_dequantize rejected its arguments (code {code})"
    return True


def _codec(tensor: torch.Tensor) -> ctypes.CDLL | None:
    """The block int8 kernel for `tensor`'s device (None: torch's path runs)."""
    kind = {"cpu": "quantize", "cuda": "quantize_cuda"}.get(tensor.device.type)
    return _kernel(kind) if kind is not None else None


def _check_cuda(lib: ctypes.CDLL, code: int, name: str) -> None:
    assert code != 1, f"{name} rejected its arguments"
    if code:
        raise RuntimeError(f"zerorun {name} launch failed: {lib.zr_cuda_quantize_error_string(code).decode()}")


def status() -> dict[str, str]:
    """Per kernel, one line: loaded / built / not built yet / failed / unavailable, and why. Builds nothing."""
    out = {}
    for kind in KINDS:
        state = _loaded.get(kind)
        unavailable = _unavailable_reason(kind)
        if unavailable is not None:
            out[kind] = f"unavailable: {unavailable}"
            continue
        directory = build_dir(kind)
        if state is not None and state.lib is not None:
            isa = f", {state.lib.zr_cpu_adam_isa_name(state.lib.zr_cpu_adam_isa()).decode()}" \
                if kind == "cpu_adam" else ""
            if kind == "aio":
                isa = f", {_aio_backend(state.lib)} backend"
            if kind == "quantize":
                isa = f", {state.lib.zr_quantize_isa_name().decode()}"
            out[kind] = f"loaded{isa} (cached at {directory})"
        elif _library(directory) is not None:
            out[kind] = f"built (cached at {directory})"
        elif state is not None:
            out[kind] = f"failed: {state.reason}"
        elif (directory / "FAILED").is_file():
            out[kind] = f"failed: {(directory / 'FAILED').read_text().strip()}"
        else:
            out[kind] = "not built yet (builds on first use, or run `zerorun env --build`)"
    return out


def build(kinds: Sequence[str] = KINDS) -> dict[str, str]:
    """Build (or load from the cache) each kernel now, retrying earlier failures; their status lines."""
    unknown = [k for k in kinds if k not in SPECS]
    if unknown:
        raise ValueError(f"unknown kernels {unknown}; choose from {list(SPECS)}")
    for kind in kinds:
        _load(kind, retry_failed=True)
    return {kind: line for kind, line in status().items() if kind in kinds}


def _aio_backend(lib: ctypes.CDLL) -> str:
    """The backend the aio kernel picks here by default: `libaio` (native AIO) or `threads`."""
    engine = lib.zr_aio_create(0, 1, 1, 4096, None, 0)
    try:
        return lib.zr_aio_backend_name(lib.zr_aio_backend(engine)).decode()
    finally:
        lib.zr_aio_destroy(engine)


def aio_backend() -> str:
    """The I/O backend `zero.aio.backend: auto` gets here. Loads the aio kernel if it is built; builds nothing."""
    state = _loaded.get("aio")
    if (state is None or state.lib is None) and _unavailable_reason("aio") is None \
            and _library(build_dir("aio")) is not None:
        state = _load("aio")
    if state is None or state.lib is None:
        return "python (thread pool: the aio kernel is not loaded)"
    return _aio_backend(state.lib)


def aio_library() -> ctypes.CDLL | None:
    """The aio kernel, or None after warning once (per process) that NVMe I/O runs on Python threads."""
    return _kernel("aio")


def use_cpu_isa(level: int) -> str:
    """Restrict cpu_adam to an instruction set (-1 best, 0 generic, 1 avx2); the name of the one in use."""
    lib = _load("cpu_adam").lib
    if lib is None:
        raise BuildError(_loaded["cpu_adam"].reason)
    return lib.zr_cpu_adam_isa_name(lib.zr_cpu_adam_use_isa(level)).decode()


def use_quantize_isa(level: int) -> str:
    """Restrict the quantize kernel to an instruction set (-1 best, 0 generic, 1 avx2); the name of the one in use."""
    lib = _load("quantize").lib
    if lib is None:
        raise BuildError(_loaded["quantize"].reason)
    lib.zr_quantize_use_isa(level)
    return lib.zr_quantize_isa_name().decode()
