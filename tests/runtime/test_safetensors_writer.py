"""The safetensors writer: the same bytes whatever the memory the tensors come from and whatever the
file system allows (O_DIRECT in place, through the bounce buffer, or buffered), readable by safetensors."""

from __future__ import annotations

import errno
import os
import zlib
from pathlib import Path

import pytest
import torch

from zerorun.runtime.checkpoint import safetensors_writer
from zerorun.runtime.checkpoint.safetensors_writer import ALIGN, BOUNCE, Source
from zerorun.runtime.offload.nvme import aligned_empty

SIZES = {"a": 5000, "b": 1024, "c": 3 * BOUNCE // 4 + 7, "d": 1, "e": 0, "f": 2 * ALIGN // 4}
METADATA = {"format": "test"}


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {name: torch.randn(n, generator=g) for name, n in SIZES.items()}


def _aligned(values: dict[str, torch.Tensor]) -> list[Source]:
    """Back to back in one 4096-aligned buffer, as a checkpoint snapshot holds them: written in place."""
    whole = aligned_empty(sum(SIZES.values()), torch.float32)
    parts = dict(zip(values, whole.split(list(SIZES.values()))))
    for name, t in values.items():
        parts[name].copy_(t)
    return [Source.of(name, t) for name, t in parts.items()]


def _shifted(values: dict[str, torch.Tensor], shift: int) -> list[Source]:
    """Each tensor at `shift` elements past an aligned address: through the bounce buffer."""
    out = []
    for name, t in values.items():
        buffer = aligned_empty(t.numel() + shift, torch.float32)
        buffer[shift:].copy_(t)
        out.append(Source.of(name, buffer[shift:]))
    return out


def _chunked(values: dict[str, torch.Tensor], step: int) -> list[Source]:
    """Streamed in pieces of `step` elements from one reused aligned buffer (as from NVMe)."""
    reuse = aligned_empty(step, torch.float32)

    def pieces(t: torch.Tensor):
        for lo in range(0, t.numel(), step):
            view = reuse[:min(step, t.numel() - lo)]
            view.copy_(t[lo:lo + step])
            yield view

    return [Source(name, torch.float32, [t.numel()], lambda t=t: pieces(t)) for name, t in values.items()]


def _check(path: Path, size: int, crc: int, values: dict[str, torch.Tensor]) -> bytes:
    data = path.read_bytes()
    assert size == len(data) and crc == zlib.crc32(data)
    assert (8 + int.from_bytes(data[:8], "little")) % ALIGN == 0, "the tensor data starts on an O_DIRECT block"
    safetensors = pytest.importorskip("safetensors.torch")
    loaded = safetensors.load_file(path)
    assert list(loaded) == sorted(values) and all(torch.equal(loaded[n], values[n]) for n in values)
    return data


@pytest.mark.parametrize("layout", ["aligned", "shift1", "shift1023", "chunked-1000", "chunked-4096"])
def test_every_memory_layout_writes_the_same_file(tmp_path: Path, layout: str) -> None:
    values = _values()
    reference = tmp_path / "reference.safetensors"
    _check(reference, *safetensors_writer.write(reference, _aligned(values), METADATA), values)
    kind, _, n = layout.partition("-")
    sources = {"aligned": lambda: _aligned(values), "shift1": lambda: _shifted(values, 1),
               "shift1023": lambda: _shifted(values, 1023), "chunked": lambda: _chunked(values, int(n or 1))}[kind]()
    path = tmp_path / "x.safetensors"
    assert _check(path, *safetensors_writer.write(path, sources, METADATA), values) == reference.read_bytes()


def test_a_file_system_refusing_o_direct_gets_the_same_bytes_buffered(tmp_path: Path, monkeypatch) -> None:
    values = _values()
    reference = tmp_path / "reference.safetensors"
    expected = _check(reference, *safetensors_writer.write(reference, _aligned(values), METADATA), values)
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse_direct)
    path = tmp_path / "refused-at-open.safetensors"
    assert _check(path, *safetensors_writer.write(path, _aligned(values), METADATA), values) == expected


def test_o_direct_writes_refused_after_the_open_fall_back_to_buffered(tmp_path: Path, monkeypatch) -> None:
    values = _values()
    reference = tmp_path / "reference.safetensors"
    expected = _check(reference, *safetensors_writer.write(reference, _aligned(values), METADATA), values)
    real_write, refused = os.write, []

    def refuse_direct(fd, data):
        import fcntl
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", refuse_direct)
    path = tmp_path / "refused-at-write.safetensors"
    assert _check(path, *safetensors_writer.write(path, _shifted(values, 1), METADATA), values) == expected
    assert refused, "the first write tried O_DIRECT"


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no tmpfs at /dev/shm")
def test_tmpfs_which_refuses_o_direct(tmp_path: Path) -> None:
    values = _values()
    reference = tmp_path / "reference.safetensors"
    expected = _check(reference, *safetensors_writer.write(reference, _aligned(values), METADATA), values)
    path = Path("/dev/shm") / f"zerorun-test-{os.getpid()}.safetensors"
    try:
        assert _check(path, *safetensors_writer.write(path, _aligned(values), METADATA), values) == expected
    finally:
        path.unlink(missing_ok=True)


def test_crc32_is_zlibs() -> None:
    data = os.urandom(3 * 2**20 + 5)
    assert safetensors_writer.crc32(data) == zlib.crc32(data)
    assert safetensors_writer.crc32(data[100:], safetensors_writer.crc32(data[:100])) == zlib.crc32(data)


def test_a_snapshot_laid_out_as_the_file_is_written_in_place(tmp_path: Path, monkeypatch) -> None:
    """Only the header and the blocks where one tensor ends and the next begins pass through the
    bounce buffer; the rest goes from the tensors to the disk."""
    bounced = []
    real_flush = safetensors_writer._Sink._flush

    def count(self):
        bounced.append(self.fill)
        real_flush(self)

    monkeypatch.setattr(safetensors_writer._Sink, "_flush", count)
    path = tmp_path / "x.safetensors"
    safetensors_writer.write(path, _aligned(_values()), METADATA)
    head = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert head <= sum(bounced) <= head + (len(SIZES) + 1) * ALIGN
