"""Optimizer offload: the fp32 master and Adam moments live on the host (or on NVMe), the CPU steps.

Where the state lives is a *home*, chosen from the recipe once:

| home        | master + moments                 | a tile of the update reads/writes        |
|-------------|----------------------------------|------------------------------------------|
| `HostHome`  | host memory (pageable)           | views of the host tensors                |
| `NvmeHome`  | files under `<nvme_path>/<run>/rank-<r>/` | a ring slot the store fills and drains |

A step walks this rank's pieces (one per unit, in the optimizer-state coordinates that `FlatParams`
and `ShardedParams` share) in tiles of `buffer_mb`, and for each tile:

    device grads --D2H--> host staging --CPU Adam--> master, moments (home) --H2D--> device params
                                                     (bf16/fp16 copy written by the same kernel pass)

The transfers run on a side CUDA stream through pinned staging slots, so the D2H of tile k+1 and
the H2D of tile k-1 are in flight while the CPU updates tile k; the NVMe store overlaps its own
reads and writes the same way. Only the staging slots are pinned: pinning gigabytes of state would
take them out of the pageable pool and makes allocation slow, and the CPU is the only thing that
touches the state. On a CPU-only machine the "device" is the host: the same path runs with plain
copies, so the tests exercise it exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch

from zerorun import ops
from zerorun.offload_files import rank_dir as nvme_dir  # noqa: F401 - the layout lives there, launcher and runtime share it

HOST = torch.device("cpu")


@dataclass
class Piece:
    """One unit's part of this rank's optimizer state, and where its gradient and update live."""

    group: int
    start: int  # offset in the group's state (master, moments)
    numel: int
    grad: torch.Tensor  # this rank's reduced gradient piece (on the device)
    out: torch.Tensor | None  # where the updated parameter goes (device or host, compute dtype)
    sink: Callable[[int, torch.Tensor], None] | None = None  # or who takes it: sink(offset in piece, values)
    sink_dtype: torch.dtype = torch.float32


@dataclass
class TransferStats:
    """Bytes and seconds per direction of offload traffic, and the time the step waited on it (cumulative)."""

    bytes: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"d2h": 0.0, "h2d": 0.0})
    wait_s: float = 0.0

    def as_dict(self) -> dict[str, dict[str, float]]:
        out = {d: {"bytes": self.bytes[d], "seconds": self.seconds[d]} for d in self.bytes}
        out["wait"] = {"bytes": 0, "seconds": self.wait_s}
        return out


class Home(Protocol):
    """Where master and moments live; visits tiles of them for an update."""

    def visit(self, group: int, spans: Sequence[tuple[int, int]],
              fn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None: ...

    def held_bytes(self) -> dict[str, dict[str, int]]: ...


class HostHome:
    """Master and moments as host tensors (the optimizer's and the flat store's own)."""

    def __init__(self, master: list[torch.Tensor], exp_avg: list[torch.Tensor], exp_avg_sq: list[torch.Tensor]) -> None:
        self.master, self.exp_avg, self.exp_avg_sq = master, exp_avg, exp_avg_sq

    def visit(self, group: int, spans: Sequence[tuple[int, int]],
              fn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        """Call `fn(k, master, exp_avg, exp_avg_sq)` on the k-th span's views, in order."""
        m, v, w = self.master[group], self.exp_avg[group], self.exp_avg_sq[group]
        for k, (lo, hi) in enumerate(spans):
            fn(k, m[lo:hi], v[lo:hi], w[lo:hi])

    def held_bytes(self) -> dict[str, dict[str, int]]:
        size = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {"master": {"cpu": size(self.master)}, "optimizer": {"cpu": size(self.exp_avg + self.exp_avg_sq)}}


class NvmeHome:
    """Master and moments in files, streamed through the NVMe store's ring of aligned buffers."""

    NAMES = ("master", "exp_avg", "exp_avg_sq")

    def __init__(self, root: Path, group_numels: Sequence[int], tile_numel: int, aio, pin: bool) -> None:
        from zerorun.runtime.nvme import NvmeStore  # the aio kernel builds on first use only

        self.group_numels = list(group_numels)
        self.stores = [NvmeStore(root / f"group-{g}", {name: n for name in self.NAMES}, tile_numel=tile_numel,
                                 aio=aio, pin=pin) for g, n in enumerate(self.group_numels)]

    def place(self, group: int, master: torch.Tensor) -> None:
        """Write the initial master; the moments start at zero."""
        store = self.stores[group]
        store.write("master", master)
        zeros = torch.zeros(min(master.numel(), 2**22), dtype=torch.float32)
        for name in ("exp_avg", "exp_avg_sq"):
            for lo in range(0, master.numel(), zeros.numel()):
                hi = min(master.numel(), lo + zeros.numel())
                store.write(name, zeros[:hi - lo], start=lo)

    def read(self, group: int, name: str, out: torch.Tensor, start: int = 0) -> None:
        self.stores[group].read(name, out, start=start)

    def write(self, group: int, name: str, src: torch.Tensor, start: int = 0) -> None:
        self.stores[group].write(name, src, start=start)

    def visit(self, group: int, spans: Sequence[tuple[int, int]],
              fn: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]) -> None:
        index = {lo: k for k, (lo, _) in enumerate(spans)}

        def update(lo: int, hi: int, views: dict[str, torch.Tensor]) -> None:
            fn(index[lo], views["master"], views["exp_avg"], views["exp_avg_sq"])

        self.stores[group].for_each_tile(list(self.NAMES), list(spans), update, write_back=list(self.NAMES))

    def io_stats(self) -> tuple[dict[str, dict[str, float]], float]:
        """Bytes and seconds of NVMe reads and writes, and the seconds the step waited on them."""
        total = {"nvme_read": {"bytes": 0, "seconds": 0.0}, "nvme_write": {"bytes": 0, "seconds": 0.0}}
        wait = 0.0
        for store in self.stores:
            s = store.stats
            total["nvme_read"]["bytes"] += s.bytes_read
            total["nvme_read"]["seconds"] += s.read_s
            total["nvme_write"]["bytes"] += s.bytes_written
            total["nvme_write"]["seconds"] += s.write_s
            wait += s.wait_s
        return total, wait

    def held_bytes(self) -> dict[str, dict[str, int]]:
        nbytes = sum(n * 4 for n in self.group_numels)
        ring = sum(store.held_bytes() for store in self.stores)
        return {"master": {"nvme": nbytes}, "optimizer": {"nvme": 2 * nbytes}, "comm": {"cpu": ring}}

    def close(self) -> None:
        for store in self.stores:
            store.close()


class Transfers:
    """Device<->host copies through a ring of staging slots; asynchronous on CUDA, plain copies on CPU.

    `fetch(k)` returns tile k's gradient on the host, having started tile k+1's copy first;
    `send(dst, src)` copies an updated host tile to its device destination and returns at once.
    A slot is reused only after the copy that last read or wrote it has finished.
    """

    SLOTS = 2

    def __init__(self, device: torch.device, tile_numel: int, pin: bool) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        pin = pin and self.cuda and torch.cuda.is_available()
        self._grad = [torch.empty(tile_numel, dtype=torch.float32, pin_memory=pin) for _ in range(self.SLOTS)]
        self._out = [torch.empty(tile_numel * 4, dtype=torch.uint8, pin_memory=pin) for _ in range(self.SLOTS)]
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._grad_ready: list = [None] * self.SLOTS
        self._out_free: list = [None] * self.SLOTS
        self.stats = TransferStats()
        self._tiles: list[torch.Tensor] = []
        self._launched = -1
        self._sent = 0

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._grad + self._out)

    # -- gradients, device -> host -----------------------------------------------------------
    def begin(self, grad_tiles: list[torch.Tensor]) -> None:
        """Start a pass over `grad_tiles` (device views); the first copy starts now."""
        self._tiles, self._launched = grad_tiles, -1
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # gradients are complete
        self._launch(0)

    def _launch(self, k: int) -> None:
        if k >= len(self._tiles) or k <= self._launched:
            return
        src, slot = self._tiles[k], k % self.SLOTS
        self._grad_ready[slot] = self._copy(self._grad[slot][:src.numel()], src, "d2h")
        self._launched = k

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> torch.cuda.Event | None:
        """Copy on the side stream (an event marks its end), or at once on CPU."""
        started = time.perf_counter()
        event = None
        if self.cuda:
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
        else:
            dst.copy_(src)
        self.stats.seconds[direction] += time.perf_counter() - started
        self.stats.bytes[direction] += src.numel() * src.element_size()
        return event

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            started = time.perf_counter()
            event.synchronize()
            self.stats.wait_s += time.perf_counter() - started

    def fetch(self, k: int) -> torch.Tensor:
        """Tile k's gradient in host staging (valid until `fetch(k + SLOTS)`)."""
        self._launch(k)
        self._launch(k + 1)  # in flight while the caller updates tile k
        slot = k % self.SLOTS
        self._wait(self._grad_ready[slot])
        self._grad_ready[slot] = None
        return self._grad[slot][:self._tiles[k].numel()]

    # -- updated parameters, host -> device ----------------------------------------------------
    def out_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging tile for the next `send` (waits until its previous copy has left)."""
        slot = self._sent % self.SLOTS
        self._wait(self._out_free[slot])
        self._out_free[slot] = None
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self._out[slot][:nbytes].view(dtype)

    def send(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy `src` (the last `out_slot`) into `dst`; asynchronous on CUDA."""
        self._out_free[self._sent % self.SLOTS] = self._copy(dst, src, "h2d")
        self._sent += 1

    def finish(self) -> None:
        """The device's compute stream waits for every copy (the parameter all-gather follows)."""
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._tiles = []


def cut(pieces: Sequence[Piece], tile_numel: int) -> list[tuple[Piece, int, int]]:
    """Tiles (piece, lo, hi) of at most `tile_numel` elements, in order; lo/hi count inside the piece."""
    return [(p, lo, min(p.numel, lo + tile_numel)) for p in pieces for lo in range(0, p.numel, tile_numel)]


class OffloadedAdam:
    """Runs an Adam(W) step over pieces whose state lives in `home`, streaming gradients and updates."""

    def __init__(self, optimizer, home: Home, device: torch.device, tile_numel: int, pin: bool) -> None:
        self.optimizer = optimizer  # ShardedAdamW: param groups, hyper-parameters and step counts
        self.home = home
        self.tile_numel = tile_numel
        self.transfers = Transfers(device, tile_numel, pin)

    @torch.no_grad()
    def step(self, pieces: list[list[Piece]], grad_divisor: float) -> None:
        for g, group in enumerate(self.optimizer.param_groups):
            tiles = cut(pieces[g], self.tile_numel)
            if not tiles:
                continue
            self.optimizer.steps[g] += 1
            beta1, beta2 = group["betas"]
            hyper = dict(step=self.optimizer.steps[g], lr=float(group["lr"]), beta1=float(beta1),
                         beta2=float(beta2), eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                         decoupled=self.optimizer.decoupled, grad_divisor=grad_divisor)
            self.transfers.begin([piece.grad[lo:hi] for piece, lo, hi in tiles])

            def update(k: int, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
                piece, lo, hi = tiles[k]
                grad = self.transfers.fetch(k)
                out = piece.out[lo:hi] if piece.out is not None else None
                deliver = None  # what sends the host copy of the update on, once written
                if out is None and piece.sink is not None:  # stage 3's parameter shard in NVMe files
                    dest = self.transfers.out_slot(hi - lo, piece.sink_dtype)
                    deliver = lambda: piece.sink(lo, dest)  # noqa: E731
                elif out is None or (out.device.type == "cpu" and self.transfers.device.type != "cpu"):
                    dest = out  # nowhere, or a host destination (stage 3's offloaded shard): written in place
                else:
                    dest = self.transfers.out_slot(hi - lo, out.dtype)
                    deliver = lambda: self.transfers.send(out, dest)  # noqa: E731
                lowp = dest if dest is not None and dest.dtype != torch.float32 else None
                ops.adamw_step(master, grad, exp_avg, exp_avg_sq, lowp_out=lowp, **hyper)
                if dest is not None and lowp is None:
                    dest.copy_(master)
                if deliver is not None:
                    deliver()

            self.home.visit(g, [(piece.start + lo, piece.start + hi) for piece, lo, hi in tiles], update)
        self.transfers.finish()

    def stats(self) -> dict[str, dict[str, float]]:
        """Cumulative traffic per direction (`d2h`, `h2d`, `nvme_read`, `nvme_write`) and `wait`."""
        out = self.transfers.stats.as_dict()
        if isinstance(self.home, NvmeHome):
            io, wait = self.home.io_stats()
            out.update(io)
            out["wait"]["seconds"] += wait
        return out
