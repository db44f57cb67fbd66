"""Write a safetensors file from tensors or from chunked sources, fsynced, with its CRC32 computed on the way.

Both checkpoint saves (synchronous in `sharded.py`, background in `background.py`) write
their files here, so the two produce the same bytes. Writing the format ourselves (an 8-byte
little-endian header length, the JSON header padded with spaces, then the raw tensor bytes back to
back) lets a tensor arrive in pieces: a rank whose optimizer state lives on NVMe streams it through
one bounded buffer instead of holding it whole in host memory. `safetensors.safe_open` reads the
result (tests check it).

The CPU a write costs is what a background save takes from training (`zerorun bench ckpt`), so:
- **O_DIRECT**: the bytes go from the caller's memory to the disk, not through the page cache (a
  buffered write copies every byte into it, and the kernel later writes it back). The header is
  padded so the tensor data starts at a multiple of `ALIGN`; a piece whose address and file offset
  are both aligned is written in place, the rest goes through one aligned bounce buffer, and the
  last partial block is written padded, then the file is truncated to its size. A file system that
  refuses O_DIRECT (tmpfs: EINVAL) gets buffered writes, with the same bytes.
- **CRC32** through ISA-L (`pip install zerorun[fast-crc]`, the same CRC32 as zlib's, several times
  faster where the CPU has carry-less multiply), else `zlib.crc32`.
Every write is an `os.write`, and both CRC32s release the GIL: a background writer does not stall
training threads.
"""

from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

try:  # the optional extra `fast-crc`: the same CRC32, computed with carry-less multiply
    from isal.isal_zlib import crc32 as _crc32_impl
except ImportError:  # pragma: no cover - exercised where isal is absent
    _crc32_impl = zlib.crc32

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
WRITE_CHUNK = 1 << 26  # bytes per os.write
ALIGN = 4096  # O_DIRECT's unit: addresses, file offsets and lengths are multiples of it
BOUNCE = 1 << 22  # bytes of the aligned buffer for pieces that cannot be written in place


def crc32(data: bytes | memoryview, value: int = 0) -> int:
    """zlib's CRC32 of `data`, continuing from `value` (ISA-L's when installed: same result, faster)."""
    return int(_crc32_impl(data, value))


def file_crc32(path: Path) -> int:
    """The CRC32 of a whole file, read in 16 MiB pieces."""
    crc, chunk = 0, bytearray(1 << 24)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(chunk):
            crc = crc32(memoryview(chunk)[:n], crc)
    return crc


@dataclass
class Source:
    """One tensor of a file: its name, dtype, shape, and a function yielding its elements in order as
    contiguous CPU tensors (the whole tensor at once, or consecutive pieces)."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    chunks: Callable[[], Iterator[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> Source:
        t = tensor.detach()
        return cls(name, t.dtype, list(t.shape), lambda: iter([t]))


def header(sources: list[Source], metadata: dict[str, str]) -> bytes:
    """The length-prefixed JSON header describing `sources` laid out back to back, padded with spaces
    so that the data starts at a multiple of `ALIGN` (see `data_start`)."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for s in sources:
        entries[s.name] = {"dtype": DTYPES[s.dtype], "shape": s.shape, "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % ALIGN)
    return struct.pack("<Q", len(text)) + text


def write(path: Path, sources: list[Source], metadata: dict[str, str],
          pace: Callable[[], None] | None = None) -> tuple[int, int]:
    """Write `sources` to `path` and fsync it; (size in bytes, CRC32 of the whole file).
    `pace` runs between chunks (tests slow a writer down with it)."""
    head = header(sources, metadata)
    with _Sink(path) as sink:
        sink.append(memoryview(head), None)
        crc = crc32(head)
        for s in sources:
            written = 0
            for piece in s.chunks():
                data, address = _bytes_of(piece)
                for lo in range(0, len(data), WRITE_CHUNK):
                    part = data[lo:lo + WRITE_CHUNK]
                    sink.append(part, address + lo)
                    crc = crc32(part, crc)
                    if pace is not None:
                        pace()
                written += len(data)
            assert written == s.nbytes, f"{path}: {s.name} gave {written} bytes, its header says {s.nbytes}"
        size = sink.close()
    return size, crc


def _bytes_of(tensor: torch.Tensor) -> tuple[memoryview, int]:
    """The bytes of a contiguous CPU tensor, and the address of the first."""
    flat = tensor.detach().reshape(-1)
    assert flat.device.type == "cpu" and flat.is_contiguous(), "sources yield contiguous CPU tensors"
    if flat.numel() == 0:
        return memoryview(b""), 0
    array: Any = flat.view(torch.uint8).numpy()  # a buffer (numpy's stubs do not say so on 3.10, or are absent)
    return memoryview(array).cast("B"), flat.data_ptr()


class _Sink:
    """A file written front to back: with O_DIRECT where the file system takes it, else buffered."""

    def __init__(self, path: Path) -> None:
        self.fd, self.direct = _open(path)
        self.size = 0  # bytes appended so far
        self.bounce = mmap.mmap(-1, BOUNCE) if self.direct else None  # page-aligned memory
        self.view = memoryview(self.bounce) if self.bounce is not None else None
        self.fill = 0  # bytes waiting in the bounce buffer (they follow the ones on disk)

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.view = self.bounce = None  # unmapped once unreferenced (a traceback may still hold a slice)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def append(self, data: memoryview, address: int | None) -> None:
        """Add `data` (at `address` in memory; None: unknown) to the end of the file."""
        self.size += len(data)
        while len(data):
            if not self.direct:
                self._out(data)
                return
            assert self.view is not None  # direct writes have their bounce buffer
            in_step = address is not None and (address - self.fill) % ALIGN == 0  # file offset ~ address
            at_block = in_step and address is not None and address % ALIGN == 0
            if at_block and self.fill:
                self._flush()  # the bounce holds whole blocks: what follows is written in place
            if at_block and len(data) >= ALIGN:
                n = len(data) // ALIGN * ALIGN
            else:  # to the bounce buffer, up to where address and file offset are both aligned (if ever)
                n = min(len(data), BOUNCE - self.fill)
                if in_step and address is not None and address % ALIGN:
                    n = min(n, -address % ALIGN)
                self.view[self.fill:self.fill + n] = data[:n]
                self.fill += n
                if self.fill == BOUNCE:
                    self._flush()
                data, address = data[n:], None if address is None else address + n
                continue
            self._out(data[:n])
            assert address is not None  # written in place: the address was known
            data, address = data[n:], address + n

    def close(self) -> int:
        """Write what is left, truncate the padding of the last block, fsync; the file's size."""
        if self.fill:
            assert self.view is not None
            end = self.fill + -self.fill % ALIGN
            self.view[self.fill:end] = bytes(end - self.fill)
            self.fill = end
            self._flush()
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)
        return self.size

    def _flush(self) -> None:
        assert self.view is not None
        self._out(self.view[:self.fill])
        self.fill = 0

    def _out(self, data: memoryview) -> None:
        done = 0
        while done < len(data):
            try:
                done += os.write(self.fd, data[done:])
            except OSError as exc:
                if not (self.direct and exc.errno == errno.EINVAL):
                    raise
                self._buffered()  # the file system took the O_DIRECT open but refuses its writes

    def _buffered(self) -> None:
        fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
        self.direct = False


def _open(path: Path) -> tuple[int, bool]:
    """(file descriptor, whether it writes with O_DIRECT)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o644), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644), False
