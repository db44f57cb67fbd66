"""The flat way's update: one path for every placement of the optimizer state, and every elementwise kernel.

For each param group, this rank's pieces (one per unit: its reduced gradient and where the update
goes) are cut into tiles; the home visits the matching tiles of the master and the optimizer's state
kinds, and for each:

    gradient tile --transfers.fetch--> kernel: the update of (master, state kinds)
                                        + the compute-dtype copy into target.staging(...)
                                       --target.deliver--> the parameters (in place, H2D copy, file)

The kernel is a `TileKernel`: zerorun's fused Adam(W) (`FusedAdam`, which writes the bf16/fp16 copy
in the same pass), or the script's own elementwise optimizer on the tile (elementwise.py), whose
copy is made here after it. With the state in device memory (`Direct` transfers) a tile is a whole
piece and the fused kernel writes the bf16/fp16 parameters (or, in fp32, the parameters are the
master) in place: one kernel call per unit, no copy. Offloaded, tiles are `buffer_mb` and the copies
are pipelined with the kernel. The arithmetic is the same kernel on the same fp32 values either way,
so every placement gives the same bits (tests/runtime/test_offload.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Protocol

import torch

from zerorun import ops
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.offload.homes import MASTER, Home
from zerorun.runtime.offload.transfers import Transfers
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


class TileKernel(Protocol):
    """One group's update for one step, applied tile by tile."""

    def update(self, views: dict[str, torch.Tensor], grad: torch.Tensor, lowp_out: torch.Tensor | None) -> bool:
        """Update the tile's `views` (its master and state kinds, fp32, in place) from its summed `grad`; True when
        it also wrote the master's compute-dtype copy into `lowp_out` (given for bf16/fp16 parameters)."""


class FusedAdam:
    """zerorun's Adam(W) kernel (`ops.adamw_step`) with one group's arguments for one step."""

    def __init__(self, hyper: dict[str, Any]) -> None:
        self.hyper = hyper  # the kernel's arguments (update.py: `FusedGroup.arguments`)

    def update(self, views: dict[str, torch.Tensor], grad: torch.Tensor, lowp_out: torch.Tensor | None) -> bool:
        ops.adamw_step(views[MASTER], grad, views["exp_avg"], views["exp_avg_sq"], lowp_out=lowp_out, **self.hyper)
        return lowp_out is not None


Backup = Callable[[int, tuple[int, int], dict[str, torch.Tensor]], None]  # before(k, span, views)


class FlatStep:
    """Runs a `TileKernel` over pieces whose state lives in `home`, moving data through `transfers`."""

    def __init__(self, home: Home, transfers: Transfers, tile_numel: int, direct: Transfers | None = None,
                 device: torch.device = torch.device("cpu")) -> None:
        """`transfers` carry the tiles whose state is away from the device (host, NVMe); `direct` those whose state is
        on it (the device's share with `offload_optimizer_ratio` < 1; everything when nothing is offloaded)."""
        self.home = home
        self.transfers = transfers
        self.direct = direct or transfers
        self.tile_numel = tile_numel
        self.device = device

    def finish(self) -> None:
        """End a pass: the device's compute stream waits for every copy of it."""
        self.transfers.finish()
        if self.direct is not self.transfers:
            self.direct.finish()

    def on_device(self, piece: Piece) -> bool:
        """Whether the piece's state lives on the device (updated there, by the device's kernel)."""
        return self.home.place_of(piece.group, piece.start) == "device"

    @torch.no_grad()
    def run_pieces(self, g: int, pieces: list[Piece], kernel: TileKernel, after: Any = None,
                   before: Backup | None = None) -> list[Tile]:
        """Update `pieces` of group `g` with `kernel`; returns the tiles updated. The pieces whose state is on the
        device go first (their kernels queue on the device), then the host's, which the host updates meanwhile.
        `after`: a CUDA event the gradients' copies wait for; `before(k, span, views)` sees each tile's state just
        before its update (the overlap's backup). The caller ends the pass with `finish()`."""
        done: list[Tile] = []
        for transfers, chosen in ((self.direct, [p for p in pieces if self.on_device(p)]),
                                  (self.transfers, [p for p in pieces if not self.on_device(p)])):
            tiles = cut(chosen, self.tile_numel)
            if tiles:
                transfers.begin([piece.grad[lo:hi] for piece, lo, hi in tiles], after)
                spans = [(piece.start + lo, piece.start + hi) for piece, lo, hi in tiles]
                self.home.visit(g, spans, partial(self._update, transfers, tiles, spans, kernel, before))
            done += tiles
        return done

    @torch.no_grad()
    def restore(self, g: int, tiles: list[Tile], saved: Callable[[int, int, str], torch.Tensor]) -> None:
        """Put back group `g`'s state of `tiles` from `saved(lo, hi, kind)` (state offsets), and send the
        parameters the restored master's compute-dtype values (the cast the kernel's copy-out makes). The tiles are
        host tiles (only those are updated under the backward); the caller ends the pass with `finish()`."""
        spans = [(piece.start + lo, piece.start + hi) for piece, lo, hi in tiles]

        def put_back(k: int, views: dict[str, torch.Tensor]) -> None:
            for kind, tensor in views.items():
                tensor.copy_(saved(*spans[k], kind))
            piece, lo, hi = tiles[k]
            out = piece.target.staging(self.transfers, lo, hi)
            if out is not None:
                out.copy_(views[MASTER])
                piece.target.deliver(self.transfers, lo, hi, out)
        self.home.visit(g, spans, put_back)

    def _update(self, transfers: Transfers, tiles: list[Tile], spans: list[tuple[int, int]], kernel: TileKernel,
                before: Backup | None, k: int, views: dict[str, torch.Tensor]) -> None:
        piece, lo, hi = tiles[k]
        if before is not None:
            before(k, spans[k], views)
        grad = transfers.fetch(k)
        out = piece.target.staging(transfers, lo, hi)
        lowp = out if out is not None and out.dtype != torch.float32 else None
        wrote = kernel.update(views, grad, lowp)
        if out is not None:
            if not wrote:  # an fp32 copy of the master (stage 3's offloaded fp32 shard), or a kernel that writes none
                out.copy_(views[MASTER])
            piece.target.deliver(transfers, lo, hi, out)

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
        if self.direct is not self.transfers:
            report.add("comm", self.device.type, self.direct.held_bytes())  # its scratch: device memory
