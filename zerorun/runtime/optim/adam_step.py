"""The optimizer update: one path for every placement of the optimizer state.

For each param group, this rank's pieces (one per unit: its reduced gradient and where the update
goes) are cut into tiles; the home visits the matching tiles of master and moments, and for each:

    gradient tile --transfers.fetch--> kernel: Adam(W) on (master, exp_avg, exp_avg_sq)
                                        + the compute-dtype copy into target.staging(...)
                                       --target.deliver--> the parameters (in place, H2D copy, file)

With the state in device memory (`Direct` transfers) a tile is a whole piece and the kernel writes
the bf16/fp16 parameters (or, in fp32, the parameters are the master) in place: one kernel call
per unit, no copy. Offloaded, tiles are `buffer_mb` and the copies are pipelined with the kernel.
The arithmetic is the same kernel on the same fp32 values either way, so every placement gives
the same bits (tests/runtime/test_offload.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from zerorun import ops
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.offload.homes import Home
from zerorun.runtime.offload.transfers import Transfers
from zerorun.runtime.optim.optimizer import ShardedAdamW
from zerorun.runtime.store import UpdateTarget


@dataclass
class Piece:
    """One unit's part of this rank's optimizer state: its gradient and where its update goes."""

    group: int
    start: int  # offset in the group's state (master, moments)
    numel: int
    grad: torch.Tensor  # this rank's reduced (summed) gradient piece, on the device
    target: UpdateTarget


Tile = tuple[Piece, int, int]  # (piece, lo, hi): elements [lo, hi) counted inside the piece


def cut(pieces: list[Piece], tile_numel: int) -> list[Tile]:
    """Tiles of at most `tile_numel` elements, in order (an empty piece has none)."""
    return [(p, lo, min(p.numel, lo + tile_numel)) for p in pieces for lo in range(0, p.numel, tile_numel)]


class AdamStep:
    """Runs Adam(W) over pieces whose state lives in `home`, moving data through `transfers`."""

    def __init__(self, optimizer: ShardedAdamW, home: Home, transfers: Transfers, tile_numel: int) -> None:
        self.optimizer = optimizer  # param groups, hyper-parameters and step counts
        self.home = home
        self.transfers = transfers
        self.tile_numel = tile_numel

    @torch.no_grad()
    def run(self, pieces: list[list[Piece]], grad_divisor: float) -> None:
        """Update every group; gradients are divided by `grad_divisor` (world x loss scale / clip) in the kernel."""
        for g in range(len(self.optimizer.param_groups)):
            tiles = cut(pieces[g], self.tile_numel)
            if not tiles:
                continue
            hyper = self.optimizer.group_step(g, grad_divisor)
            self.transfers.begin([piece.grad[lo:hi] for piece, lo, hi in tiles])
            spans = [(piece.start + lo, piece.start + hi) for piece, lo, hi in tiles]
            self.home.visit(g, spans, partial(self._update, tiles, hyper))
        self.transfers.finish()

    def _update(self, tiles: list[Tile], hyper: dict, k: int, master: torch.Tensor, exp_avg: torch.Tensor,
                exp_avg_sq: torch.Tensor) -> None:
        piece, lo, hi = tiles[k]
        grad = self.transfers.fetch(k)
        out = piece.target.staging(self.transfers, lo, hi)
        lowp = out if out is not None and out.dtype != torch.float32 else None
        ops.adamw_step(master, grad, exp_avg, exp_avg_sq, lowp_out=lowp, **hyper)
        if out is not None:
            if lowp is None:  # an fp32 copy of the master (stage 3's offloaded fp32 shard)
                out.copy_(master)
            piece.target.deliver(self.transfers, lo, hi, out)

    def stats(self) -> dict[str, dict[str, float]]:
        """Cumulative offload traffic: `d2h`, `h2d`, `nvme_read`, `nvme_write` and `wait` (empty in memory)."""
        out = self.transfers.stats()
        for kind, entry in self.home.io_stats().items():
            if kind == "wait" and "wait" in out:
                out["wait"]["seconds"] += entry["seconds"]
            else:
                out[kind] = entry
        return out

    def account(self, report: MemoryReport) -> None:
        self.home.account(report)
        report.add("comm", "cpu", self.transfers.held_bytes())  # staging slots are host memory
