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

from typing import Protocol, Sequence

import torch

from zerorun.runtime.homes import Home
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.placement import Place, Placement
from zerorun.runtime.store import InMaster, ParamFile, ParamTensor, UpdateTarget
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


class FileShard:
    """One file per group under `<nvme_path>/<run>/rank-<r>/params/`, read through an aligned bounce buffer."""

    def __init__(self, placement: Placement, group_numels: Sequence[int], dtype: torch.dtype,
                 largest_piece: int) -> None:
        from zerorun.runtime.nvme import NvmeStore, aligned_empty, check_nvme_path
        from zerorun.offload_files import rank_dir

        self.dtype = dtype
        self.group_numels = list(group_numels)
        root = rank_dir(placement.params_nvme, placement.run, placement.rank) / "params"
        check_nvme_path(placement.params_nvme, "zero.offload_param.nvme_path", dtype.itemsize * sum(group_numels), root)
        self.store = NvmeStore(root, {self._file(g): n for g, n in enumerate(group_numels)},
                               tile_numel=placement.tile_numel, aio=placement.aio, pin=placement.param_pin, dtype=dtype)
        self._bounce = aligned_empty(largest_piece, dtype, placement.param_pin)

    @staticmethod
    def _file(group: int) -> str:
        return f"params-{group}"

    def fill(self, unit: Unit, out: torch.Tensor) -> None:
        bounce = self._bounce[:out.numel()]
        self.store.read(self._file(unit.group), bounce, start=unit.state_offset)
        out.copy_(bounce)  # synchronous: the bounce buffer is reused by the next piece

    def write(self, group: int, start: int, values: torch.Tensor) -> None:
        flat = values.reshape(-1)
        for lo in range(0, flat.numel(), 2**24):  # bounded host memory for large writes
            chunk = flat[lo:lo + 2**24].to("cpu", self.dtype).contiguous()
            self.store.write(self._file(group), chunk, start=start + lo)

    def target(self, unit: Unit) -> UpdateTarget:
        return ParamFile(lambda lo, values: self.store.write(self._file(unit.group), values,
                                                             start=unit.state_offset + lo), self.dtype)

    def account(self, report: MemoryReport) -> None:
        report.add("params", "nvme", self.dtype.itemsize * sum(self.group_numels))
        report.add("comm", "cpu", self._bounce.numel() * self._bounce.element_size())


def build_param_shard(placement: Placement, home: Home, units: Sequence[Unit], group_numels: Sequence[int],
                      dtype: torch.dtype) -> ParamShard:
    """The shard stage 3 gathers from, for this placement."""
    if placement.optimizer is Place.DEVICE:
        return MasterShard(home)
    if placement.params is Place.NVME:
        return FileShard(placement, group_numels, dtype, max((u.shard_numel for u in units), default=0))
    return TensorShard(group_numels, dtype, placement.place_device(placement.params), placement.param_pin)
