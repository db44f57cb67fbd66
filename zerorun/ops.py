"""zerorun's kernels (`kernels/`): built once per machine, loaded by every rank, honest fallbacks.

`adamw_step` updates one flat fp32 shard in place. It runs our kernel for the tensors' device
(`cpu_adam` on CPU, `fused_adam` on CUDA) when that kernel is built or can be built now, else
torch's fused Adam(W) with the same numerics, after one warning that says why. `aio_library` is the
asynchronous O_DIRECT reader/writer behind the NVMe store (`zerorun/runtime/offload/aio.py` wraps it; its
fallback is a Python thread pool). `quantize_blocks` / `dequantize_blocks` are the block int8 codec of
qwZ and qgZ (`zerorun/runtime/comm/quantize.py` calls them; its fallback is torch, with the same bits).

Build and cache: `zerorun/kernel_cache.py` (one build per machine and source, shared by the ranks of a
node through a file lock, failures reused for a minute). A build says so when it starts ("building the CPU
Adam kernel (once per machine, ...)") and when it ends, and `build_seconds()` counts the time this process
spent building or waiting for a build: the telemetry keeps it out of the step time its ETA extrapolates. The CPU kernels are compiled for AVX2+FMA
and baseline x86-64 and pick at run time, so one cache can be shared by different machines.

`ZERORUN_KERNELS=off` skips our kernels (torch's fused Adam, no warning). The checks before a build,
where the CUDA toolkit is (asked of nvcc, not guessed from PATH) and the summary of a failed build
are in `zerorun/toolchain.py`.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from zerorun.kernel_cache import (  # noqa: F401 - KernelSpec, cache_root and sources_dir are ops' public names too
    KINDS,
    SPECS,
    KernelSpec,
    Obtained,
    build_dir,
    build_or_wait,
    built_library,
    cache_root,
    sources_dir,
)
from zerorun.toolchain import BuildError

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class KernelWarning(UserWarning):
    """A zerorun kernel is unavailable and a fallback (torch's Adam, Python I/O threads) runs instead."""


# ---- per process: what is loaded, what is not and why ----

@dataclass
class LoadedKernel:
    lib: ctypes.CDLL | None
    reason: str  # why lib is None ("" when loaded)
    unavailable: bool = False  # nothing to build here (no CUDA device, disabled): not a failure


_loaded: dict[str, LoadedKernel] = {}
_warned: set[str] = set()
_process_lock = threading.Lock()
_build_seconds = 0.0  # this process's time spent building kernels or waiting for a build (`build_seconds`)
NAMES = {"cpu_adam": "CPU Adam", "fused_adam": "CUDA Adam", "aio": "NVMe I/O", "quantize": "int8 codec",
         "quantize_cuda": "CUDA int8 codec"}


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


def load_kernel(kind: str, retry_failed: bool = False) -> LoadedKernel:
    """This process's handle on a kernel: loaded from the cache, built now, or the reason it is not."""
    global _build_seconds
    with _process_lock:
        state = _loaded.get(kind)
        if state is not None and (state.lib is not None or not retry_failed):
            return state
        reason = _unavailable_reason(kind)
        if reason is not None:
            state = LoadedKernel(None, reason, unavailable=True)
        else:
            started = time.monotonic()
            try:
                library, obtained = build_or_wait(kind, retry_failed, lambda before: _announce(kind, before))
            except BuildError as exc:
                state = LoadedKernel(None, str(exc))
                _build_seconds += time.monotonic() - started
            else:
                _built(kind, obtained, time.monotonic() - started, library)
                try:
                    state = LoadedKernel(_open(kind, library), "")
                except (OSError, AttributeError) as exc:  # a damaged cache entry: say how to rebuild it
                    state = LoadedKernel(None, f"cannot load {library} ({exc}); delete {library.parent} to rebuild")
        _loaded[kind] = state
        return state


def _announce(kind: str, before: float | None) -> None:
    """A build is starting in this process: say so, with how long the last one took here (a first build of
    a big kernel takes long enough to look like a hang, or a step 50 times too slow)."""
    took = f", ~{before:.0f} s last time" if before is not None else ""
    print(f"zerorun: building the {NAMES[kind]} kernel (once per machine and torch version{took}; the other ranks "
          "of this node wait for it) ...", file=sys.stderr, flush=True)


def _built(kind: str, obtained: Obtained, seconds: float, library: Path) -> None:
    """Count the time a build (or the wait for one) took, and say that a build is done."""
    global _build_seconds
    if obtained is Obtained.CACHED:
        return
    _build_seconds += seconds
    if obtained is Obtained.BUILT:
        print(f"zerorun: built the {NAMES[kind]} kernel in {seconds:.1f} s ({library.parent})", file=sys.stderr,
              flush=True)


def build_seconds() -> float:
    """Seconds this process has spent building kernels or waiting for another process's build."""
    return _build_seconds


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
    state = load_kernel(kind)
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
                isa = f", {aio_backend_of(state.lib)} backend"
            if kind == "quantize":
                isa = f", {state.lib.zr_quantize_isa_name().decode()}"
            out[kind] = f"loaded{isa} (cached at {directory})"
        elif built_library(directory) is not None:
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
        load_kernel(kind, retry_failed=True)
    return {kind: line for kind, line in status().items() if kind in kinds}


def aio_backend_of(lib: ctypes.CDLL) -> str:
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
            and built_library(build_dir("aio")) is not None:
        state = load_kernel("aio")
    if state is None or state.lib is None:
        return "python (thread pool: the aio kernel is not loaded)"
    return aio_backend_of(state.lib)


def aio_library() -> ctypes.CDLL | None:
    """The aio kernel, or None after warning once (per process) that NVMe I/O runs on Python threads."""
    return _kernel("aio")


def use_cpu_isa(level: int) -> str:
    """Run cpu_adam's variant `level` (-1 this CPU's default, 0 generic, 1 avx2, 2 avx512), or the widest this CPU
    has below it; the name of the one in use."""
    lib = load_kernel("cpu_adam").lib
    if lib is None:
        raise BuildError(_loaded["cpu_adam"].reason)
    return lib.zr_cpu_adam_isa_name(lib.zr_cpu_adam_use_isa(level)).decode()


def use_quantize_isa(level: int) -> str:
    """Restrict the quantize kernel to an instruction set (-1 best, 0 generic, 1 avx2); the name of the one in use."""
    lib = load_kernel("quantize").lib
    if lib is None:
        raise BuildError(_loaded["quantize"].reason)
    lib.zr_quantize_use_isa(level)
    return lib.zr_quantize_isa_name().decode()
