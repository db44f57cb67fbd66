"""How gradients reach the optimizer state and updates reach the parameters, when they live apart.

The optimizer step (`adam_step.py`) walks this rank's pieces in tiles and, per tile, fetches the
gradient, runs the Adam kernel where the state lives, and hands the updated compute-dtype values
on. What "fetch" and "hand on" cost depends only on where the state's `Home` is:

| state in        | transfers       | a tile's gradient                | an update bound for the parameters       |
|-----------------|-----------------|----------------------------------|------------------------------------------|
| device memory   | `Direct`        | the gradient itself (a view)     | written in place by the kernel           |
| host or NVMe    | `StagingRing`   | copied D2H into a staging slot   | written into a slot, copied H2D          |

`StagingRing` runs its copies on a side CUDA stream through pinned slots: the gradient of tile k+1
and the update of tile k-1 move while the CPU updates tile k. A slot is reused only after the copy
that last used it has finished. On a CPU-only machine the "device" is the host: the same ring runs
with plain copies, so the tests exercise it exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass
class TransferStats:
    """Bytes and seconds per direction of offload traffic, and the time the step waited on it (cumulative).

    A copy's seconds are its own duration: on CUDA the time between two events around it on the
    copy stream, counted once they have both passed (`settle`). The host-side time of an
    asynchronous copy is only its launch, which would report rates many times PCIe's.
    """

    bytes: dict[str, int] = field(default_factory=lambda: {"d2h": 0, "h2d": 0})
    seconds: dict[str, float] = field(default_factory=lambda: {"d2h": 0.0, "h2d": 0.0})
    wait_s: float = 0.0
    pending: list = field(default_factory=list)  # (direction, start event, end event) of copies in flight

    def settle(self) -> None:
        """Add the durations of the copies that have finished."""
        still = []
        for direction, start, end in self.pending:
            if end.query():
                self.seconds[direction] += start.elapsed_time(end) / 1e3
            else:
                still.append((direction, start, end))
        self.pending = still

    def as_dict(self) -> dict[str, dict[str, float]]:
        self.settle()
        out = {d: {"bytes": self.bytes[d], "seconds": self.seconds[d]} for d in self.bytes}
        out["wait"] = {"bytes": 0, "seconds": self.wait_s}
        return out


class Transfers(Protocol):
    """Moves one step's gradient tiles to the kernel and its updates back (see the module docstring)."""

    def begin(self, grad_tiles: list[torch.Tensor], after: Any = None) -> None:
        """Start a pass over `grad_tiles`; `after`: a CUDA event their copies wait for (else the current stream)."""

    def fetch(self, k: int) -> torch.Tensor: ...

    def reaches(self, dest: torch.Tensor) -> bool: ...

    def out_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def send(self, dest: torch.Tensor, staged: torch.Tensor) -> None: ...

    def finish(self) -> None: ...

    def held_bytes(self) -> int: ...

    def stats(self) -> dict[str, dict[str, float]]: ...


class Direct:
    """The state lives in device memory with the gradients: the kernel reads each gradient where it is and writes
    the parameters in place; parameters kept in host memory (stage 3's offloaded shard beside a device share of the
    optimizer) get their tile through a device scratch buffer and a copy down, queued on the same stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._tiles: list[torch.Tensor] = []
        self._scratch: torch.Tensor | None = None  # made at the first parameter tile bound for the host

    def begin(self, grad_tiles: list[torch.Tensor], after: Any = None) -> None:
        self._tiles = grad_tiles

    def fetch(self, k: int) -> torch.Tensor:
        return self._tiles[k]

    def reaches(self, dest: torch.Tensor) -> bool:
        return dest.device == self.device

    def out_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._scratch[:nbytes].view(dtype)

    def send(self, dest: torch.Tensor, staged: torch.Tensor) -> None:
        dest.copy_(staged, non_blocking=True)  # stream-ordered before the scratch is written again

    def finish(self) -> None:
        self._tiles = []

    def held_bytes(self) -> int:
        return self._scratch.numel() if self._scratch is not None else 0

    def stats(self) -> dict[str, dict[str, float]]:
        return {}


class StagingRing:
    """Device<->host copies through a ring of staging slots; asynchronous on CUDA, plain copies on CPU.

    On CUDA, `fetch(k)` returns tile k's gradient on the host having started tile k+1's copy first,
    and `send(dest, staged)` copies an updated host tile (the last `out_slot`) to the device and
    returns at once: two slots each way. On a CPU-only machine every copy is over when it returns,
    so one slot each way does as much, and holds less (`zerorun bench step --systems zero2-offload`,
    its "live" column).
    """

    CUDA_SLOTS = 2  # per direction: one copying, one in use by the optimizer

    @classmethod
    def default_slots(cls, cuda: bool) -> int:
        """Slots per direction when none are asked for (`estimate.offload_buffers` counts the same)."""
        return cls.CUDA_SLOTS if cuda else 1

    def __init__(self, device: torch.device, tile_numel: int, pin: bool, slots: int | None = None) -> None:
        """`slots` per direction: `CUDA_SLOTS` on CUDA, 1 on CPU unless given (tests rotate more on CPU)."""
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = slots or self.default_slots(self.cuda)
        pin = pin and self.cuda and torch.cuda.is_available()
        self._grad = [torch.empty(tile_numel, dtype=torch.float32, pin_memory=pin) for _ in range(self.slots)]
        self._out = [torch.empty(tile_numel * 4, dtype=torch.uint8, pin_memory=pin) for _ in range(self.slots)]
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._grad_ready: list = [None] * self.slots
        self._out_free: list = [None] * self.slots
        self._stats = TransferStats()
        self._tiles: list[torch.Tensor] = []
        self._launched = -1
        self._sent = 0

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._grad + self._out)

    def stats(self) -> dict[str, dict[str, float]]:
        return self._stats.as_dict()

    # -- gradients, device -> host -----------------------------------------------------------
    def begin(self, grad_tiles: list[torch.Tensor], after: Any = None) -> None:
        """Start a pass over `grad_tiles` (device views); the first copy starts now, once the gradients are
        complete: after the CUDA event `after` (recorded where they were written), else everything queued on
        the current stream."""
        self._tiles, self._launched = grad_tiles, -1
        if self._stream is not None:
            if after is not None:
                self._stream.wait_event(after)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._launch(0)

    def _launch(self, k: int) -> None:
        if k >= len(self._tiles) or k <= self._launched:
            return
        src, slot = self._tiles[k], k % self.slots
        self._grad_ready[slot] = self._copy(self._grad[slot][:src.numel()], src, "d2h")
        self._launched = k

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str) -> torch.cuda.Event | None:
        """Copy on the side stream (an event marks its end, another its start for the statistics), or
        at once on CPU."""
        self._stats.bytes[direction] += src.numel() * src.element_size()
        if not self.cuda:
            started = time.perf_counter()
            dst.copy_(src)
            self._stats.seconds[direction] += time.perf_counter() - started
            return None
        with torch.cuda.stream(self._stream):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(self._stream)
            dst.copy_(src, non_blocking=True)
            end.record(self._stream)
        self._stats.pending.append((direction, start, end))
        return end

    def _wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            started = time.perf_counter()
            event.synchronize()
            self._stats.wait_s += time.perf_counter() - started

    def fetch(self, k: int) -> torch.Tensor:
        """Tile k's gradient in host staging (valid until `fetch(k + slots)`)."""
        self._launch(k)
        if self.slots > 1:
            self._launch(k + 1)  # in flight while the caller updates tile k
        slot = k % self.slots
        self._wait(self._grad_ready[slot])
        self._grad_ready[slot] = None
        return self._grad[slot][:self._tiles[k].numel()]

    # -- updated parameters, host -> device ----------------------------------------------------
    def reaches(self, dest: torch.Tensor) -> bool:
        """True when the CPU kernel writes `dest` itself: host memory beside a CUDA device (on a CPU-only
        machine the "device" parameters are host memory too, but go through the ring like device ones)."""
        return dest.device.type == "cpu" and self.cuda

    def out_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A host staging tile for the next `send` (waits until its previous copy has left)."""
        slot = self._sent % self.slots
        self._wait(self._out_free[slot])
        self._out_free[slot] = None
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self._out[slot][:nbytes].view(dtype)

    def send(self, dest: torch.Tensor, staged: torch.Tensor) -> None:
        """Copy `staged` (the last `out_slot`) into `dest`; asynchronous on CUDA."""
        self._out_free[self._sent % self.slots] = self._copy(dest, staged, "h2d")
        self._sent += 1

    def finish(self) -> None:
        """The device's compute stream waits for every copy (the parameter all-gather follows)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
        self._tiles = []
