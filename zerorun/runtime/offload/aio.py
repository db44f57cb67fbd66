"""Asynchronous reads and writes of aligned host buffers to O_DIRECT files: one small interface, two engines.

    engine = open_engine(recipe.zero.aio)
    handle = engine.submit(fd, buffer.data_ptr(), nbytes, offset, write=False)   # returns at once
    ...                                                                          # overlap work here
    seconds_in_flight = engine.wait(handle)                                      # or AioError

`KernelEngine` drives `kernels/aio.cpp` (built by `zerorun.ops`): Linux native AIO through raw
syscalls where the kernel allows it, else its own pool of pread/pwrite threads. `PythonEngine` is
the fallback when the kernel cannot be built: a Python thread pool of `os.preadv`/`os.pwritev`
(they release the GIL), with the same chunking, the same error messages and the same results.

Both cut a request into `block_size` chunks and keep at most `queue_depth` of them in flight (the
thread pools: at most `threads`). On an O_DIRECT fd, buffers, lengths and offsets must be 4096-byte
aligned: a request that is not fails with EINVAL at once, even where the file system would quietly
fall back to buffered I/O (ext4 on recent kernels does). `zerorun.runtime.offload.nvme` aligns everything.
"""

from __future__ import annotations

import ctypes
import errno as errnos
import fcntl
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from zerorun.errors import ZerorunError

ALIGN = 4096
BACKENDS = ("auto", "libaio", "threads", "python")  # python: the fallback, forced (tests, `bench io`)
_BACKEND_CODES = {"auto": 0, "libaio": 1, "threads": 2}


class AioError(ZerorunError, OSError):
    """An asynchronous read or write failed; the message says which, where and (EINVAL) what was misaligned."""


@dataclass(frozen=True)
class AioSettings:
    """The knobs of `zero.aio` (`zerorun.config.AioConfig` has the same fields and their docs)."""

    block_size: int = 8 * 2**20
    queue_depth: int = 8
    threads: int = 4
    backend: str = "auto"


class AioEngine(Protocol):
    backend: str  # what runs: "libaio", "threads" (both the kernel) or "python"

    # The handle is the engine's own (an id, a request): opaque to callers, who pass it back to `wait`.
    def submit(self, fd: int, address: int, nbytes: int, offset: int, write: bool) -> Any: ...

    def wait(self, handle: Any) -> float: ...

    def close(self) -> None: ...


def open_engine(aio: Any) -> AioEngine:
    """An engine for `aio` (a `zero.aio` config): the kernel when it is built or can be built, else Python's.

    backend "libaio" insists on native AIO (an error where the kernel refuses it or the aio kernel is
    unavailable); "auto" and "threads" fall back to the Python thread pool after one warning.
    """
    settings = AioSettings(int(aio.block_size), int(aio.queue_depth), int(aio.threads), str(aio.backend))
    if settings.backend not in BACKENDS:
        raise ZerorunError(f"zero.aio.backend: {settings.backend!r} is not one of {', '.join(BACKENDS)}.")
    if settings.block_size % ALIGN or settings.block_size <= 0:
        raise ZerorunError(f"zero.aio.block_size: {settings.block_size} is not a positive multiple of {ALIGN} "
                           "(O_DIRECT transfers whole aligned blocks).")
    if settings.backend == "python":
        return PythonEngine(settings)
    from zerorun import ops

    lib = ops.aio_library()
    if lib is None:
        if settings.backend == "libaio":
            raise ZerorunError(f"zero.aio.backend: libaio needs zerorun's aio kernel, which is unavailable "
                               f"({ops.status()['aio']}); use backend: auto or threads.")
        return PythonEngine(settings)
    return KernelEngine(lib, settings)


class KernelEngine:
    """`kernels/aio.cpp` through ctypes (calls release the GIL)."""

    def __init__(self, lib: ctypes.CDLL, settings: AioSettings) -> None:
        self._lib = lib
        message = ctypes.create_string_buffer(512)
        self._engine = lib.zr_aio_create(_BACKEND_CODES[settings.backend], settings.queue_depth, settings.threads,
                                         settings.block_size, message, len(message))
        if not self._engine:
            raise ZerorunError(f"zero.aio.backend: {message.value.decode()}; use backend: auto or threads.")
        self.backend = lib.zr_aio_backend_name(lib.zr_aio_backend(self._engine)).decode()
        self._message = ctypes.create_string_buffer(512)
        self._inflight_ns = ctypes.c_int64()

    def submit(self, fd: int, address: int, nbytes: int, offset: int, write: bool) -> int:
        assert self._engine, "submit on a closed aio engine"
        handle = self._lib.zr_aio_submit(self._engine, fd, address, nbytes, offset, int(write))
        if handle < 0:
            raise AioError(-handle, f"aio submit: {os.strerror(-handle)} (nbytes {nbytes}, offset {offset})")
        return int(handle)

    def wait(self, handle: int) -> float:
        """Block until the request is done; the seconds it was in flight. AioError if it failed."""
        code = self._lib.zr_aio_wait(self._engine, handle, ctypes.byref(self._inflight_ns), self._message,
                                     len(self._message))
        if code != 0:
            raise AioError(code if code > 0 else errnos.EINVAL, self._message.value.decode())
        return self._inflight_ns.value / 1e9

    def close(self) -> None:
        """Wait for the chunks in flight, cancel queued ones, free the engine."""
        if self._engine:
            self._lib.zr_aio_destroy(self._engine)
            self._engine = None


@dataclass
class _PythonRequest:
    submitted: float
    chunks: list[Future]


class PythonEngine:
    """The fallback: a thread pool of os.preadv/os.pwritev, one chunk per task."""

    backend = "python"

    def __init__(self, settings: AioSettings) -> None:
        self.block_size = settings.block_size
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(settings.threads, settings.queue_depth)),
                                        thread_name_prefix="zerorun-aio")

    def submit(self, fd: int, address: int, nbytes: int, offset: int, write: bool) -> _PythonRequest:
        request = _PythonRequest(time.perf_counter(), [])
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT and (address | nbytes | offset) % ALIGN:
            refused: Future = Future()  # as the kernel does: some file systems would quietly go buffered
            refused.set_exception(AioError(errnos.EINVAL, describe_failure(write, errnos.EINVAL, address, nbytes,
                                                                            offset, fd)))
            request.chunks.append(refused)
            return request
        for done in range(0, nbytes, self.block_size):
            size = min(self.block_size, nbytes - done)
            request.chunks.append(self._pool.submit(_transfer, fd, address + done, size, offset + done, write))
        return request

    def wait(self, handle: _PythonRequest) -> float:
        finished, first_error = handle.submitted, None
        for chunk in handle.chunks:  # every chunk, even after a failure: none may still touch the buffer
            try:
                finished = max(finished, chunk.result())
            except AioError as exc:
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return finished - handle.submitted

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _transfer(fd: int, address: int, nbytes: int, offset: int, write: bool) -> float:
    """Move one chunk (retrying partial transfers); the time it finished. AioError on failure or a short transfer."""
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    done = 0
    while done < nbytes:
        try:
            moved = (os.pwritev if write else os.preadv)(fd, [view[done:]], offset + done)
        except InterruptedError:
            continue
        except OSError as exc:
            raise AioError(exc.errno, describe_failure(write, exc.errno, address, nbytes, offset, fd)) from None
        if moved == 0:
            break
        done += moved
    if done != nbytes:
        code = errnos.ENOSPC if write else errnos.EIO
        raise AioError(code, describe_failure(write, None, address, nbytes, offset, fd, moved=done))
    return time.perf_counter()


def describe_failure(write: bool, code: int | None, address: int, nbytes: int, offset: int, fd: int,
                     moved: int = 0) -> str:
    """The message of a failed chunk, worded like the kernel's (kernels/aio.cpp: describe_failure)."""
    op = "write" if write else "read"
    if code is None:
        hint = "; is the disk full?" if write else "; the file ends before the requested range"
        return f"short {op}: {moved} of {nbytes} bytes at file offset {offset} (fd {fd}){hint}"
    if code == errnos.EINVAL:
        ok = lambda v: "aligned" if v % ALIGN == 0 else "NOT aligned"  # noqa: E731
        return (f"{op} failed: EINVAL (Invalid argument) at file offset {offset}: O_DIRECT needs the buffer address, "
                f"length and file offset aligned to {ALIGN} bytes: buffer {address:#x} ({ok(address)}), length "
                f"{nbytes} ({ok(nbytes)}), offset {offset} ({ok(offset)})")
    return f"{op} failed: {os.strerror(code)} (errno {code}) at file offset {offset}, {nbytes} bytes (fd {fd})"
