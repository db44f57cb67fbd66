"""NVMe tile store: one rank's offloaded state in O_DIRECT files, streamed through a ring of aligned buffers.

    check_nvme_path(path, "zero.offload_optimizer.nvme_path", need_bytes)    # before training starts
    store = NvmeFiles(root, {"master": n, "exp_avg": n, "exp_avg_sq": n}, tile_numel=t, aio=recipe.zero.aio)
    store.write("master", master)                                          # place whole tensors
    store.for_each_tile(names, spans, update, write_back=names)            # the optimizer's pass

Files. One file per name under `root` (the caller's `<nvme_path>/<run>/rank-<r>/`), preallocated
and rounded up to 4096 bytes, opened with O_DIRECT: no page cache, so the host RAM the offload
saves is not quietly spent again by the kernel. O_DIRECT moves whole 4096-byte blocks between
4096-aligned buffers, while callers address elements (an fp32 span can start anywhere): every
transfer covers the aligned blocks around its elements, and a write that owns only part of a
block first reads that block (read-modify-write).

The pipeline (`for_each_tile`). Spans are cut into tiles of at most `tile_numel` elements; each
tile has one slot of a ring of three per name. While `fn` updates tile k in its slot, the read of
tile k+1 and the write-back of tile k-1 are in flight:

    slot k%3:      read k  ->  fn(k)  ->  write k
    slot (k+1)%3:  ...write k-2 done -> read k+1 (during fn(k)) -> fn(k+1) -> ...

Neighbouring tiles can share a block (tile k-1 ends and tile k starts inside it). Tile k's read
of that block started before fn(k-1) ran, so after fn(k) the store copies tile k-1's part of the
block from k-1's slot into k's, and tile k-1's write-back leaves the shared block to tile k. Every
block is then written by exactly one tile, after every update in it, and no write races a read of
the same block. Spans must be increasing and disjoint (the optimizer's pieces are).
"""

from __future__ import annotations

import errno
import os
import time
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from zerorun.errors import ZerorunError
from zerorun.offload_files import MEMORY_FILESYSTEMS, check_nvme_path, filesystem_type, size_text  # noqa: F401 - re-exported
from zerorun.runtime.offload.aio import ALIGN, AioEngine, AioError, open_engine

RING_SLOTS = 3  # tiles in flight per tensor: read of tile k+1, update of tile k, write of tile k-1


def aligned_empty(numel: int, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
    """An uninitialised 1-D tensor whose data starts on a 4096-byte boundary (O_DIRECT can use it).

    torch's allocator only promises 64-byte alignment, so this over-allocates and slices. Pinned only
    where CUDA exists (the CPU build of torch raises on `pin_memory=True`).
    """
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    shift = -raw.data_ptr() % ALIGN
    return raw[shift:shift + nbytes].view(dtype)


# ---- tiles -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tile:
    """Elements [start, end) of every file, and the aligned bytes that carry them."""

    start: int
    end: int
    lo: int  # first byte of the covering blocks
    hi: int  # end of the covering blocks
    write_hi: int  # end of this tile's write-back: hi, or hi - ALIGN when the next tile writes the shared block
    shares_head: bool  # the previous tile has elements in this tile's first block


def plan_tiles(spans: Sequence[tuple[int, int]], tile_numel: int, itemsize: int) -> list[Tile]:
    """Cut increasing, disjoint element spans into tiles of at most `tile_numel`, with their blocks."""
    cuts: list[tuple[int, int]] = []
    previous_end = 0
    for start, end in spans:
        if start < previous_end or end < start:
            raise ValueError(f"for_each_tile: spans must be increasing and disjoint; got {list(spans)}")
        cuts += [(lo, min(end, lo + tile_numel)) for lo in range(start, end, tile_numel)]
        previous_end = end
    covers = [(start * itemsize // ALIGN * ALIGN, _round_up(end * itemsize)) for start, end in cuts]
    tiles = []
    for k, ((start, end), (lo, hi)) in enumerate(zip(cuts, covers)):
        next_shares = k + 1 < len(covers) and covers[k + 1][0] < hi
        tiles.append(Tile(start, end, lo, hi, hi - ALIGN if next_shares else hi, k > 0 and lo < covers[k - 1][1]))
    return tiles


def _round_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


# ---- the store ---------------------------------------------------------------------------------

@dataclass
class IoStats:
    """Cumulative NVMe traffic: bytes moved (whole blocks), seconds requests were in flight, and the
    seconds the caller blocked waiting on them."""

    bytes_read: int = 0
    bytes_written: int = 0
    read_s: float = 0.0
    write_s: float = 0.0
    wait_s: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


Batch = list[tuple[object, int]]  # requests submitted together: (handle, bytes)


class NvmeFiles:
    """Named flat tensors of one dtype in O_DIRECT files under `root`; see the module docstring."""

    def __init__(self, root: str | Path, tensors: dict[str, int], *, tile_numel: int, aio: Any, pin: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        if tile_numel < 1:
            raise ValueError(f"NvmeFiles: tile_numel must be positive, got {tile_numel}")
        self.root = Path(root)
        self.dtype = dtype
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        assert ALIGN % self.itemsize == 0, f"{dtype} elements would straddle {ALIGN}-byte blocks"
        self.numels = dict(tensors)
        self.tile_numel = tile_numel
        self.pin = pin and torch.cuda.is_available()
        self.stats = IoStats()
        self._slot_bytes = _round_up(tile_numel * self.itemsize) + ALIGN  # a tile's blocks, wherever it starts
        self._ring: dict[str, list[torch.Tensor]] = {}  # per name, RING_SLOTS buffers (allocated on first use)
        self._bounce: torch.Tensor | None = None  # the synchronous helpers' buffer
        self._fds: dict[str, int] = {}
        self._paths: list[tuple[Path, int]] = []  # each file this store made, with its inode
        self.root.mkdir(parents=True, exist_ok=True)
        self._engine: AioEngine = open_engine(aio)
        self._cleanup = weakref.finalize(self, _remove, self._engine, self._fds, self._paths, self.root)
        try:
            for name, numel in self.numels.items():
                self._fds[name] = self._create(name, numel)
        except BaseException:
            self.close()
            raise

    @property
    def backend(self) -> str:
        return self._engine.backend

    def _create(self, name: str, numel: int) -> int:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"NvmeFiles: {name!r} cannot be a file name")
        path = self.root / f"{name}.bin"
        # a file of its own, never one an earlier store at this path (an engine not yet collected) still holds
        # open: that store's cleanup then removes only its own file, and this one keeps its data
        path.unlink(missing_ok=True)
        try:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            except FileNotFoundError:  # that earlier store's cleanup removed the empty directory just now
                self.root.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ZerorunError(f"{path}: cannot open for O_DIRECT I/O ({exc.strerror}); NVMe offload needs a "
                               "directory on a real disk.") from None
        self._paths.append((path, os.fstat(fd).st_ino))
        size = _round_up(numel * self.itemsize)
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:  # a file system without fallocate: a sparse file works too
                    os.ftruncate(fd, size)
                    return fd
                os.close(fd)
                raise ZerorunError(f"{path}: no space left for {size_text(size)} of offloaded {name}; free space on "
                                   f"{self.root} or choose a larger disk.") from None
        return fd

    # -- bookkeeping -------------------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Host RAM of the ring buffers and the bounce buffer (allocated on first use)."""
        buffers = [t for slots in self._ring.values() for t in slots] + ([self._bounce] if self._bounce is not None
                                                                          else [])
        return sum(t.numel() for t in buffers)

    def disk_bytes(self) -> int:
        return sum(_round_up(n * self.itemsize) for n in self.numels.values())

    def close(self) -> None:
        """Close the files and the I/O engine, delete the files, and `root` if nothing else is in it."""
        self._cleanup()

    # -- synchronous helpers -----------------------------------------------------------------------
    def write(self, name: str, src: torch.Tensor, start: int = 0) -> None:
        """Write `src` (this store's dtype, any device) at element `start` of `name`; returns when on disk."""
        src = self._checked(name, src, start).reshape(-1)
        stop, position = start + src.numel(), self._direct_body(name, src, start, write=True)
        while position < stop:
            bounce = self._bounce_buffer()  # made on first use, then kept
            lo, end, hi = self._chunk(position, stop)
            edges = {block for block, partial in ((lo, position * self.itemsize > lo),
                                                  (hi - ALIGN, end * self.itemsize < hi)) if partial}
            # read-modify-write: the blocks this write owns only in part keep their other bytes
            self._finish([self._submit(name, bounce.data_ptr() + block - lo, ALIGN, block, False)
                          for block in sorted(edges)], write=False)
            bounce[position * self.itemsize - lo:end * self.itemsize - lo].view(self.dtype).copy_(
                src[position - start:end - start])
            self._finish([self._submit(name, bounce.data_ptr(), hi - lo, lo, True)], write=True)
            position = end

    def read(self, name: str, out: torch.Tensor, start: int = 0) -> None:
        """Fill `out` (this store's dtype, any device) from element `start` of `name`."""
        self._checked(name, out, start)
        if not out.is_contiguous():
            staged = torch.empty(out.numel(), dtype=self.dtype)
            self.read(name, staged, start)
            out.copy_(staged.view(out.shape))
            return
        flat = out.view(-1)
        stop, position = start + flat.numel(), self._direct_body(name, flat, start, write=False)
        while position < stop:
            bounce = self._bounce_buffer()  # made on first use, then kept
            lo, end, hi = self._chunk(position, stop)
            self._finish([self._submit(name, bounce.data_ptr(), hi - lo, lo, False)], write=False)
            flat[position - start:end - start].copy_(
                bounce[position * self.itemsize - lo:end * self.itemsize - lo].view(self.dtype))
            position = end

    def _checked(self, name: str, tensor: torch.Tensor, start: int) -> torch.Tensor:
        if name not in self.numels:
            raise KeyError(f"NvmeFiles: no file {name!r}; it holds {sorted(self.numels)}")
        if tensor.dtype != self.dtype:
            raise ValueError(f"NvmeFiles: {name} holds {self.dtype}, got a {tensor.dtype} tensor")
        if start < 0 or start + tensor.numel() > self.numels[name]:
            raise IndexError(f"NvmeFiles: elements [{start}, {start + tensor.numel()}) are outside {name} "
                             f"({self.numels[name]} elements)")
        return tensor

    def _direct_body(self, name: str, tensor: torch.Tensor, start: int, write: bool) -> int:
        """Move the whole blocks at the front of `tensor` straight from/to its memory when O_DIRECT can
        use it (host, contiguous, aligned like its file offset); the element where the rest starts."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.data_ptr() % ALIGN \
                or start * self.itemsize % ALIGN:
            return start
        body = tensor.numel() * self.itemsize // ALIGN * ALIGN
        if body:
            self._finish([self._submit(name, tensor.data_ptr(), body, start * self.itemsize, write)], write=write)
        return start + body // self.itemsize

    def _chunk(self, position: int, stop: int) -> tuple[int, int, int]:
        """The next bounce-sized piece from element `position`: (first byte, end element, end byte)."""
        lo = position * self.itemsize // ALIGN * ALIGN
        end = min(stop, (lo + self._slot_bytes) // self.itemsize)
        return lo, end, _round_up(end * self.itemsize)

    def _bounce_buffer(self) -> torch.Tensor:
        if self._bounce is None:
            self._bounce = aligned_empty(self._slot_bytes, torch.uint8, self.pin)
        return self._bounce

    # -- the pipeline ------------------------------------------------------------------------------
    def for_each_tile(self, names: list[str], spans: list[tuple[int, int]],
                      fn: Callable[[int, int, dict[str, torch.Tensor]], None], write_back: list[str]) -> None:
        """For each tile of `spans` in order: read it from every file in `names`, call
        `fn(start, end, {name: 1-D view})`, write the `write_back` files back. Reads, `fn` and writes
        of neighbouring tiles overlap (module docstring); the views are valid only inside `fn`. If `fn`
        raises, the tiles before are on disk and the rest untouched."""
        unknown = [n for n in [*names, *write_back] if n not in self.numels]
        if unknown or not set(write_back) <= set(names):
            raise KeyError(f"NvmeFiles.for_each_tile: names {names} and write_back {write_back} must be files of "
                           f"this store ({sorted(self.numels)}), write_back a subset of names")
        tiles = plan_tiles(spans, self.tile_numel, self.itemsize)
        for name in names:
            if tiles and tiles[-1].end > self.numels[name]:
                raise IndexError(f"NvmeFiles.for_each_tile: span end {tiles[-1].end} is past the end of {name} "
                                 f"({self.numels[name]} elements)")
        ring = {name: self._slots(name) for name in names}
        reads: dict[int, Batch] = {}
        writes: dict[int, Batch] = {}

        def submit_read(k: int) -> None:
            tile, slot = tiles[k], k % RING_SLOTS
            reads[k] = [self._submit(name, ring[name][slot].data_ptr(), tile.hi - tile.lo, tile.lo, False)
                        for name in names]

        def submit_write(k: int) -> None:
            tile, slot = tiles[k], k % RING_SLOTS
            nbytes = tile.write_hi - tile.lo  # 0: the whole tile is in a block the next tile writes
            writes[k] = [self._submit(name, ring[name][slot].data_ptr(), nbytes, tile.lo, True)
                         for name in write_back] if nbytes else []

        try:
            if tiles:
                submit_read(0)
            for k, tile in enumerate(tiles):
                self._finish(reads.pop(k), write=False)
                if k + 1 < len(tiles):
                    if k - 2 in writes:  # its slot is the one tile k+1 reads into
                        self._finish(writes.pop(k - 2), write=True)
                    submit_read(k + 1)
                slot = k % RING_SLOTS
                offset = tile.start * self.itemsize - tile.lo
                nbytes = (tile.end - tile.start) * self.itemsize
                try:
                    fn(tile.start, tile.end, {name: ring[name][slot][offset:offset + nbytes].view(self.dtype)
                                              for name in names})
                except BaseException:
                    if k > 0 and write_back:
                        self._flush_deferred(tiles[k - 1], ring, (k - 1) % RING_SLOTS, write_back)
                    raise
                if tile.shares_head:  # the previous tile's part of our first block is newer in its slot
                    previous = tiles[k - 1]
                    for name in write_back:
                        source = ring[name][(k - 1) % RING_SLOTS][tile.lo - previous.lo:]
                        ring[name][slot][:offset].copy_(source[:offset])
                if write_back:
                    submit_write(k)
            for k in sorted(writes):
                self._finish(writes.pop(k), write=True)
        finally:
            self._drain([*reads.values(), *writes.values()])  # after an error: nothing may outlive the slots

    def _flush_deferred(self, tile: Tile, ring: dict[str, list[torch.Tensor]], slot: int,
                        write_back: list[str]) -> None:
        """Write the block `tile` left to the next tile, whose fn failed: every tile before the failing one
        ends up on disk, the failing one and those after it untouched."""
        if tile.write_hi == tile.hi:
            return
        start = tile.write_hi - tile.lo
        try:
            self._finish([self._submit(name, ring[name][slot].data_ptr() + start, tile.hi - tile.write_hi,
                                       tile.write_hi, True) for name in write_back], write=True)
        except AioError:
            pass  # the exception from fn is the one to report

    def _slots(self, name: str) -> list[torch.Tensor]:
        if name not in self._ring:
            self._ring[name] = [aligned_empty(self._slot_bytes, torch.uint8, self.pin) for _ in range(RING_SLOTS)]
        return self._ring[name]

    # -- requests ----------------------------------------------------------------------------------
    def _submit(self, name: str, address: int, nbytes: int, offset: int, write: bool) -> tuple[object, int]:
        return self._engine.submit(self._fds[name], address, nbytes, offset, write), nbytes

    def _finish(self, batch: Batch, write: bool) -> None:
        """Wait for requests submitted together; count their bytes, their time in flight and our wait."""
        waited = time.perf_counter()
        inflight, failure = 0.0, None
        for handle, _ in batch:
            try:
                inflight = max(inflight, self._engine.wait(handle))
            except AioError as exc:  # wait for the rest anyway: they still use their buffers
                failure = failure or exc
        self.stats.wait_s += time.perf_counter() - waited
        if failure is not None:
            raise failure
        nbytes = sum(n for _, n in batch)
        if write:
            self.stats.bytes_written += nbytes
            self.stats.write_s += inflight
        else:
            self.stats.bytes_read += nbytes
            self.stats.read_s += inflight

    def _drain(self, batches: list[Batch]) -> None:
        for batch in batches:
            for handle, _ in batch:
                try:
                    self._engine.wait(handle)
                except AioError:
                    pass  # the error that stopped the pass is the one to report


def _remove(engine: AioEngine, fds: dict[str, int], paths: list[tuple[Path, int]], root: Path) -> None:
    """Close and delete a store's files (weakref.finalize: on close(), garbage collection or exit); a file a later
    store made at the same path is that store's, and stays."""
    engine.close()
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    for path, inode in paths:
        try:
            if os.stat(path).st_ino == inode:
                path.unlink()
        except FileNotFoundError:
            pass
    try:
        root.rmdir()  # only if nothing else lives there
    except OSError:
        pass
