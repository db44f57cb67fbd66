"""Write a safetensors file from tensors or from chunked sources, fsynced, with its CRC32 computed on the way.

Both checkpoint saves (synchronous in `checkpoint.py`, background in `checkpoint_async.py`) write
their files here, so the two produce the same bytes. Writing the format ourselves (an 8-byte
little-endian header length, the JSON header padded with spaces to 8 bytes, then the raw tensor
bytes back to back) lets a tensor arrive in pieces: a rank whose optimizer state lives on NVMe
streams it through one bounded buffer instead of holding it whole in host memory. Every write is an
`os.write` of a buffer, which releases the GIL: a background writer does not stall training threads.
`safetensors.safe_open` reads the result (tests check it).
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch

DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL"}
WRITE_CHUNK = 1 << 26  # bytes per os.write


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
    """The length-prefixed JSON header describing `sources` laid out back to back."""
    entries: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for s in sources:
        entries[s.name] = {"dtype": DTYPES[s.dtype], "shape": s.shape, "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write(path: Path, sources: list[Source], metadata: dict[str, str],
          pace: Callable[[], None] | None = None) -> tuple[int, int]:
    """Write `sources` to `path` and fsync it; (size in bytes, CRC32 of the whole file).
    `pace` runs between chunks (tests slow a writer down with it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        head = header(sources, metadata)
        size, crc = _write_all(fd, memoryview(head)), zlib.crc32(head)
        for s in sources:
            written = 0
            for piece in s.chunks():
                data = _bytes_of(piece)
                for lo in range(0, len(data), WRITE_CHUNK):
                    part = data[lo:lo + WRITE_CHUNK]
                    size += _write_all(fd, part)
                    crc = zlib.crc32(part, crc)
                    if pace is not None:
                        pace()
                written += len(data)
            assert written == s.nbytes, f"{path}: {s.name} gave {written} bytes, its header says {s.nbytes}"
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, crc


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().reshape(-1)
    assert flat.device.type == "cpu" and flat.is_contiguous(), "sources yield contiguous CPU tensors"
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]  # ndarray is a buffer; its stubs do not say so on 3.10


def _write_all(fd: int, data: memoryview) -> int:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
    return done
