"""Stage 3's parameter shard: where every gather reads this rank's piece of a unit from.

| placement                                  | shard                                        | the step's update  |
|--------------------------------------------|----------------------------------------------|--------------------|
| optimizer in device memory                 | `MasterShard`: the fp32 master (cast on read) | is the master      |
| optimizer offloaded, `offload_param: none` | `TensorShard` on the device, compute dtype   | copied into it     |
| `offload_param: cpu`                       | `TensorShard` in host memory                 | written into it    |
| `offload_param: nvme`                      | `FileShard`: one file per param group        | written through    |

With the optimizer offloaded the master lives on the host or NVMe and only the optimizer touches
it; the kernel writes the compute-dtype copy of each update in the same pass, so gathers read a
p/N-byte shard instead of a 4p/N-byte master.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any, Protocol, Sequence

import torch

from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.offload.homes import Home
from zerorun.runtime.offload.placement import Place, Placement
from zerorun.runtime.store import InMaster, ParamFile, ParamIO, ParamTensor, UpdateTarget
from zerorun.runtime.units import Unit


class ParamShard(Protocol):
    """This rank's compute-dtype parameter shard, per param group, in optimizer-state coordinates."""

    def fill(self, unit: Unit, out: torch.Tensor) -> None:
        """Copy this rank's piece of `unit` into `out` (its slice of the unit's gathered buffer)."""

    def write(self, group: int, start: int, values: torch.Tensor) -> None:
        """Set elements from `start` of `group`'s shard from `values` (cast to the compute dtype)."""

    def target(self, unit: Unit) -> UpdateTarget:
        """Where the optimizer step sends `unit`'s updated piece."""

    def account(self, report: MemoryReport) -> None: ...

    def io(self) -> ParamIO:
        """Bytes read and written outside memory so far, and the seconds the caller waited on them."""


class MasterShard:
    """Gathers read the master in the (device memory) home: no second copy of the parameters."""

    def __init__(self, home: Home) -> None:
        self.home = home

    def fill(self, unit: Unit, out: torch.Tensor) -> None:
        self.home.read(unit.group, "master", out, start=unit.state_offset)

    def write(self, group: int, start: int, values: torch.Tensor) -> None:
        pass  # the caller wrote the master: that is the shard

    def target(self, unit: Unit) -> UpdateTarget:
        return InMaster()

    def account(self, report: MemoryReport) -> None:
        pass  # counted as master by the home

    def io(self) -> ParamIO:
        return ParamIO()


class TensorShard:
    """A compute-dtype tensor per group on the device or the host (pinned where CUDA exists)."""

    def __init__(self, group_numels: Sequence[int], dtype: torch.dtype, place: torch.device, pin: bool) -> None:
        pin = pin and place.type == "cpu" and torch.cuda.is_available()
        self.shard = [torch.empty(n, dtype=dtype, device=place, pin_memory=pin) for n in group_numels]

    def fill(self, unit: Unit, out: torch.Tensor) -> None:
        out.copy_(unit.state_slice(self.shard[unit.group]), non_blocking=True)

    def write(self, group: int, start: int, values: torch.Tensor) -> None:
        self.shard[group][start:start + values.numel()].copy_(values.reshape(-1))

    def target(self, unit: Unit) -> UpdateTarget:
        return ParamTensor(unit.state_slice(self.shard[unit.group]))

    def account(self, report: MemoryReport) -> None:
        report.add("params", self.shard[0].device.type if self.shard else "cpu",
                   sum(t.numel() * t.element_size() for t in self.shard))

    def io(self) -> ParamIO:
        return ParamIO()


class FileShard:
    """One file per group under `<nvme_path>/<run>/rank-<r>/params/`, read through aligned bounce buffers.

    The file's I/O runs on one background thread, in submission order, so it overlaps the caller:
    the step's parameter writes (`target`) queue behind each other while the next tile is updated,
    and each gather reads ahead, into a second bounce buffer, the unit that came next in the
    previous cycle of gathers (those between two steps' writes) while this one computes. One thread
    keeps every write and read in program order, so no read passes an earlier write of its blocks;
    a read-ahead issued before a write is dropped (`_generation`), and `fill`/`write` wait for
    queued writes first. Before, the caller waited on every parameter write inside the optimizer's
    tile loop and on every gather's read (`bench scale` reports the seconds blocked on NVMe).
    """

    WRITE_SLOTS = 2  # queued parameter writes: one in flight, one being filled

    def __init__(self, placement: Placement, group_numels: Sequence[int], dtype: torch.dtype,
                 largest_piece: int) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from zerorun.offload_files import rank_dir
        from zerorun.runtime.offload.nvme import NvmeFiles, aligned_empty, check_nvme_path

        self.dtype = dtype
        self.group_numels = list(group_numels)
        assert placement.params_nvme is not None, "parameters on NVMe have a zero.offload_param.nvme_path"
        root = rank_dir(placement.params_nvme, placement.run, placement.rank) / "params"
        check_nvme_path(placement.params_nvme, "zero.offload_param.nvme_path", dtype.itemsize * sum(group_numels), root)
        self.store = NvmeFiles(root, {self._file(g): n for g, n in enumerate(group_numels)},
                               tile_numel=placement.tile_numel, aio=placement.aio, pin=placement.param_pin, dtype=dtype)
        self._bounces = [aligned_empty(largest_piece, dtype, placement.param_pin) for _ in range(2)]
        self._write_slots = [aligned_empty(min(placement.tile_numel, largest_piece), dtype, placement.param_pin)
                             for _ in range(self.WRITE_SLOTS)]
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zerorun-param-io")
        self._writes: list[Future[Any]] = []  # futures of queued writes, oldest first (at most WRITE_SLOTS)
        self._written = 0  # writes submitted so far: a slot is reused every WRITE_SLOTS writes
        self._generation = 0  # bumped by every write: a read-ahead from an older generation is stale
        self._ahead: tuple[tuple[int, int], int, Future[Any], int] | None = None  # (unit key, bounce, future, generation)
        # the order of gathers between two steps' writes, this time and last time: the i-th gather
        # of this cycle reads ahead the (i+1)-th of the last one (forward and backward orders differ)
        self._cycle: list[Unit] = []
        self._last_cycle: list[Unit] = []
        self.blocked_s = 0.0  # seconds the caller waited on this file (its own reads, queued writes, read-aheads)
        self.read_ahead = {"hits": 0, "misses": 0}  # gathers served by a read-ahead, and read-aheads thrown away

    @staticmethod
    def _file(group: int) -> str:
        return f"params-{group}"

    @staticmethod
    def _key(unit: Unit) -> tuple[int, int]:
        return unit.group, unit.state_offset

    def fill(self, unit: Unit, out: torch.Tensor) -> None:
        self._drain_writes()
        key, ahead, self._ahead = self._key(unit), self._ahead, None
        bounce_index = 0
        if ahead is not None:
            self._wait(ahead[2])  # nothing may still write into that bounce buffer
            if ahead[0] == key and ahead[3] == self._generation:
                bounce_index = ahead[1]
                self.read_ahead["hits"] += 1
            else:
                ahead = None
                self.read_ahead["misses"] += 1
        bounce = self._bounces[bounce_index][:out.numel()]
        if ahead is None:
            started = time.perf_counter()
            self.store.read(self._file(unit.group), bounce, start=unit.state_offset)
            self.blocked_s += time.perf_counter() - started
        out.copy_(bounce)
        self._cycle.append(unit)
        i, last = len(self._cycle) - 1, self._last_cycle
        following = last[i + 1] if i + 1 < len(last) and self._key(last[i]) == key else None
        if following is not None:  # read it ahead into the other bounce buffer while this unit computes
            other = 1 - bounce_index
            target = self._bounces[other][:following.shard_numel]
            future = self._io.submit(self.store.read, self._file(following.group), target, following.state_offset)
            self._ahead = (self._key(following), other, future, self._generation)

    def write(self, group: int, start: int, values: torch.Tensor) -> None:
        self._drain_writes()
        self._bump()
        self._drop_read_ahead()
        flat = values.reshape(-1)
        for lo in range(0, flat.numel(), 2**24):  # bounded host memory for large writes
            chunk = flat[lo:lo + 2**24].to("cpu", self.dtype).contiguous()
            self.store.write(self._file(group), chunk, start=start + lo)

    def _write_async(self, group: int, start: int, values: torch.Tensor) -> None:
        """Queue `values` (at most a tile) for element `start` of `group`'s file; returns once copied."""
        self._bump()
        if len(self._writes) == self.WRITE_SLOTS:
            self._wait(self._writes.pop(0))  # its slot is the one this write reuses
        flat = values.reshape(-1)
        slot = self._write_slots[self._written % self.WRITE_SLOTS]
        assert flat.numel() <= slot.numel(), f"a parameter write of {flat.numel()} elements exceeds a tile"
        staged = slot[:flat.numel()]
        staged.copy_(flat)
        self._written += 1
        self._writes.append(self._io.submit(self.store.write, self._file(group), staged, start))

    def _bump(self) -> None:
        """A write: every read-ahead issued so far is stale, and the gathers since the last write are a cycle."""
        self._generation += 1
        if self._cycle:
            self._last_cycle, self._cycle = self._cycle, []

    def _drain_writes(self) -> None:
        while self._writes:
            self._wait(self._writes.pop(0))

    def _drop_read_ahead(self) -> None:
        if self._ahead is not None:
            self._wait(self._ahead[2])
            self._ahead = None

    def _wait(self, future: Future[Any]) -> None:
        started = time.perf_counter()
        future.result()  # re-raises the I/O thread's AioError here
        self.blocked_s += time.perf_counter() - started

    def target(self, unit: Unit) -> UpdateTarget:
        return ParamFile(lambda lo, values: self._write_async(unit.group, unit.state_offset + lo, values), self.dtype)

    def account(self, report: MemoryReport) -> None:
        report.add("params", "nvme", self.dtype.itemsize * sum(self.group_numels))
        buffers = [*self._bounces, *self._write_slots]
        report.add("comm", "cpu", sum(b.numel() * b.element_size() for b in buffers))

    def io(self) -> ParamIO:
        # blocked_s: the caller's waits (the file's own I/O runs on a thread; the store's wait_s is that thread's)
        return ParamIO(self.store.stats.bytes_read, self.store.stats.bytes_written, self.blocked_s)


def build_param_shard(placement: Placement, home: Home, units: Sequence[Unit], group_numels: Sequence[int],
                      dtype: torch.dtype) -> ParamShard:
    """The shard stage 3 gathers from, for this placement."""
    if placement.optimizer is Place.DEVICE:
        return MasterShard(home)
    if placement.params is Place.NVME:
        return FileShard(placement, group_numels, dtype, max((u.shard_numel for u in units), default=0))
    return TensorShard(group_numels, dtype, placement.place_device(placement.params), placement.param_pin)
