"""zerorun.runtime.offload.aio: the aio kernel's two backends and the Python fallback move the same bytes,
and fail with messages that say what went wrong (misalignment, short reads)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch

from zerorun import ops
from zerorun.runtime.offload.aio import AioError, AioSettings, KernelEngine, PythonEngine, open_engine
from zerorun.runtime.offload.nvme import aligned_empty

BACKENDS = ("libaio", "threads", "python")


@pytest.fixture(scope="module")
def aio_kernel() -> None:
    """CI must prove the kernel builds: a machine without a compiler fails here, on purpose."""
    line = ops.build(["aio"])["aio"]
    assert line.startswith("loaded"), line


@pytest.fixture(params=BACKENDS)
def engine(request: pytest.FixtureRequest, aio_kernel: None):
    engine = open_engine(AioSettings(block_size=64 * 1024, queue_depth=4, threads=3, backend=request.param))
    assert engine.backend == request.param
    yield engine
    engine.close()


def _direct_file(directory: Path, nbytes: int) -> int:
    fd = os.open(directory / "data.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.ftruncate(fd, nbytes)
    return fd


def test_writes_then_reads_back_the_same_bytes_with_requests_in_flight_together(engine, direct_io_dir: Path) -> None:
    nbytes = 3 * 2**20 + 5 * 4096  # not a multiple of the block size: the last chunk is short
    fd = _direct_file(direct_io_dir, 2 * nbytes)
    try:
        first, second = aligned_empty(nbytes, torch.uint8), aligned_empty(nbytes, torch.uint8)
        first.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        second.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
        handles = [engine.submit(fd, first.data_ptr(), nbytes, 0, True),
                   engine.submit(fd, second.data_ptr(), nbytes, nbytes, True)]
        assert all(engine.wait(h) > 0 for h in handles)
        back = aligned_empty(2 * nbytes, torch.uint8)
        engine.wait(engine.submit(fd, back.data_ptr(), 2 * nbytes, 0, False))
        assert torch.equal(back[:nbytes], first) and torch.equal(back[nbytes:], second)
    finally:
        os.close(fd)


@pytest.mark.parametrize("misaligned", ["buffer", "offset"])
def test_misalignment_fails_with_einval_naming_the_field(engine, direct_io_dir: Path, misaligned: str) -> None:
    fd = _direct_file(direct_io_dir, 8 * 4096)
    try:
        buffer = aligned_empty(4 * 4096, torch.uint8)
        address = buffer.data_ptr() + (1 if misaligned == "buffer" else 0)
        offset = 1 if misaligned == "offset" else 0
        with pytest.raises(AioError, match="EINVAL") as caught:
            engine.wait(engine.submit(fd, address, 2 * 4096, offset, False))
        assert f"{misaligned} " in str(caught.value) and "NOT aligned" in str(caught.value)
        assert caught.value.errno == 22
        engine.wait(engine.submit(fd, buffer.data_ptr(), 4096, 0, False))  # the engine still works
    finally:
        os.close(fd)


def test_reading_past_the_end_of_the_file_is_a_short_read_error(engine, direct_io_dir: Path) -> None:
    fd = _direct_file(direct_io_dir, 2 * 4096)
    try:
        buffer = aligned_empty(4 * 4096, torch.uint8)
        with pytest.raises(AioError, match="short read: .* the file ends before the requested range"):
            engine.wait(engine.submit(fd, buffer.data_ptr(), 4 * 4096, 0, False))
    finally:
        os.close(fd)


def test_kernel_backend_is_detected_at_run_time(aio_kernel: None) -> None:
    engine = open_engine(AioSettings(backend="auto"))
    try:
        assert isinstance(engine, KernelEngine) and engine.backend in ("libaio", "threads")
    finally:
        engine.close()


def test_unusable_settings_are_errors_that_name_the_key() -> None:
    with pytest.raises(Exception, match="zero.aio.block_size: 5000"):
        open_engine(AioSettings(block_size=5000))
    with pytest.raises(Exception, match="zero.aio.backend: 'uring'"):
        open_engine(AioSettings(backend="uring"))


def test_without_the_kernel_io_runs_on_python_threads_after_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct_io_dir: Path) -> None:
    monkeypatch.setenv("ZERORUN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.delenv("ZERORUN_KERNELS", raising=False)
    monkeypatch.setattr(ops, "_loaded", {})
    monkeypatch.setattr(ops, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engines = [open_engine(AioSettings(backend="auto")) for _ in range(2)]
    assert all(isinstance(e, PythonEngine) for e in engines)
    messages = [str(w.message) for w in caught if issubclass(w.category, ops.KernelWarning)]
    assert len(messages) == 1 and "aio kernel is unavailable (no C++ compiler" in messages[0], messages
    with pytest.raises(Exception, match="zero.aio.backend: libaio needs zerorun's aio kernel"):
        open_engine(AioSettings(backend="libaio"))
    for engine in engines:
        engine.close()


def test_env_reports_the_backend_auto_picks(aio_kernel: None) -> None:
    from zerorun import envreport

    kernels = envreport.collect()["kernels"]
    assert kernels["aio"].startswith(("loaded", "built")) and kernels["aio backend"] in ("libaio", "threads")
