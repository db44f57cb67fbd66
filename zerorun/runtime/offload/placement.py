"""Placement: where each kind of model state lives, decided once from the recipe and passed in.

    placement = Placement.from_recipe(recipe, device, rank)
    home = placement.optimizer_home(group_numels)      # master + optimizer state: device, host or NVMe
    transfers = placement.transfers(largest_piece)      # how gradients and updates reach that home

| `zero.offload_optimizer` | optimizer state (`Home`)             | the step's transfers | stage 3 gathers read  |
|--------------------------|--------------------------------------|----------------------|-----------------------|
| none                     | device memory (`MemoryHome`)         | `Direct`             | the master            |
| cpu                      | host memory (`MemoryHome`)           | `StagingRing`        | a compute-dtype shard |
| nvme                     | files (`NvmeHome`)                   | `StagingRing`        | a compute-dtype shard |

The stage 3 shard lives where `zero.offload_param` says (device, host, or NVMe files; see
`param_shards.py`). Nothing downstream asks which case it is in: each store and the step are
built with the home, transfers and shard that fit, and never rewired.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Sequence

import torch

from zerorun.config import AioConfig, OffloadConfig, Recipe
from zerorun.offload_files import owner as offload_owner
from zerorun.offload_files import rank_dir
from zerorun.runtime.offload.homes import Home, MemoryHome, NvmeHome, group_kinds
from zerorun.runtime.offload.transfers import Direct, StagingRing, Transfers

HOST = torch.device("cpu")


class Place(Enum):
    """A place state can live."""

    DEVICE = "device"  # the compute device (the host itself on a CPU-only machine)
    HOST = "cpu"  # host memory, beside a device
    NVME = "nvme"  # files on a local disk

    @classmethod
    def of(cls, offload: OffloadConfig) -> Place:
        return cls.of_setting(offload.device)

    @classmethod
    def of_setting(cls, device: str) -> Place:
        """The place an offload setting names: "none" (stay on the device), "cpu" or "nvme"."""
        return {"none": cls.DEVICE, "cpu": cls.HOST, "nvme": cls.NVME}[device]


@dataclass(frozen=True)
class Placement:
    """Where the optimizer state and (stage 3) the parameter shard live, and how the step streams them."""

    device: torch.device
    optimizer: Place  # master weights and moments
    params: Place  # stage 3's parameter shard (stages 0-2 keep whole parameters on the device)
    tile_numel: int  # fp32 elements per streamed tile (`offload_optimizer.buffer_mb`)
    pin: bool  # pin the optimizer's staging buffers (CUDA only)
    param_pin: bool
    aio: AioConfig
    optimizer_nvme: str | None  # `zero.offload_optimizer.nvme_path` (set when `optimizer` is NVME)
    params_nvme: str | None  # `zero.offload_param.nvme_path` (set when `params` is NVME)
    run: str | None  # files go to `<nvme_path>/<run>/rank-<rank>/`: the job id in a launch (`offload_files.owner`)
    rank: int
    host_share: float = 1.0  # `zero.offload_optimizer_ratio`: the share of an offloaded optimizer kept on the host

    @classmethod
    def from_recipe(cls, recipe: Recipe, device: torch.device, rank: int) -> Placement:
        opt, param = recipe.zero.offload_optimizer, recipe.zero.offload_param
        return cls(device, Place.of(opt), Place.of(param), max(1024, int(opt.buffer_mb * 2**20) // 4),
                   opt.pin_memory, param.pin_memory, recipe.zero.aio, opt.nvme_path, param.nvme_path,
                   offload_owner(recipe.name), rank, recipe.zero.offload_optimizer_ratio)

    @property
    def step_tile_numel(self) -> int:
        """Elements per tile of the optimizer step: whole pieces when the state is in device memory."""
        return sys.maxsize if self.optimizer is Place.DEVICE else self.tile_numel

    def optimizer_home(self, group_numels: Sequence[int],
                       master: list[list[tuple[int, torch.Tensor]]] | None = None,
                       unit_starts: Sequence[Sequence[int]] = (),
                       state_kinds: Sequence[Sequence[str]] | None = None) -> Home:
        """The home of this rank's master and flat optimizer state; `master`: segments that already hold the master
        (fp32 parameters' own pieces, device memory only); `unit_starts`: per group, the state offsets where its
        units begin (a split between host and device falls between units, so no tile crosses it); `state_kinds`:
        per group, the kinds its optimizer keeps per element (default: Adam's two moments)."""
        assert master is None or self.optimizer is Place.DEVICE, "only device memory can alias the parameters"
        if self.optimizer is Place.DEVICE:
            return MemoryHome(group_numels, self.device, master, state_kinds=state_kinds)
        if self.optimizer is Place.HOST and self.host_share < 1.0:
            host = [host_numel(n, starts, self.host_share) for n, starts in zip(group_numels, unit_starts)]
            return MemoryHome.split(group_numels, host, HOST, self.device, state_kinds)
        if self.optimizer is Place.HOST:
            return MemoryHome(group_numels, HOST, role="host", state_kinds=state_kinds)
        from zerorun.runtime.offload.nvme import check_nvme_path  # builds the aio kernel: only when used

        assert self.optimizer_nvme is not None, "an optimizer on NVMe has a zero.offload_optimizer.nvme_path"
        root = rank_dir(self.optimizer_nvme, self.run, self.rank)
        kinds = group_kinds(state_kinds, len(group_numels))
        check_nvme_path(self.optimizer_nvme, "zero.offload_optimizer.nvme_path",
                        sum(4 * n * len(k) for n, k in zip(group_numels, kinds)), root)
        return NvmeHome(root, group_numels, self.tile_numel, self.aio, self.pin, state_kinds)

    def transfers(self, largest_piece: int) -> Transfers:
        """How gradients and updates of state away from the device move; staging slots hold a tile, never more
        than `largest_piece` (the longest piece of state one unit has on this rank: no tile of a step is longer)."""
        if self.optimizer is Place.DEVICE:
            return Direct(self.device)
        return StagingRing(self.device, max(1, min(self.tile_numel, largest_piece)), self.pin)

    def place_device(self, place: Place) -> torch.device:
        """The torch device of an in-memory place."""
        assert place is not Place.NVME, "NVMe is not a torch device"
        return self.device if place is Place.DEVICE else HOST



def host_numel(numel: int, unit_starts: Sequence[int], share: float) -> int:
    """The elements of a group's state kept on the host for `share` of it: up to the first unit boundary at or past
    share x numel (the host takes the first units in state order, whose gradients come first in the backward)."""
    bounds = sorted({*unit_starts, numel})
    return next(b for b in bounds if b >= share * numel)
