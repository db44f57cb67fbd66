"""What a background checkpoint writes for this rank: its state, captured off the training path.

Two ways to capture, chosen by where the state lives (`Home.resident`; `background.py` picks):

| class           | home            | capture                                          | host memory           |
|-----------------|-----------------|--------------------------------------------------|-----------------------|
| `HostSnapshot`  | device or host  | copy every `<kind>.<group>` into host buffers    | the whole state, kept |
| `StreamedState` | NVMe            | the writer reads the files chunk by chunk         | one chunk             |

`HostSnapshot` holds the tensors back to back in one buffer starting on a 4096-byte boundary, as
the rank file holds them, so the writer sends them to the disk with O_DIRECT from where they are
(`safetensors_writer`). It copies on a side stream into pinned buffers on CUDA, after an event the training
thread recorded at the save (so the copy sees the finished step and the compute stream never
waits for it); on the CPU the same code copies with memcpy. The buffers are allocated once and
reused by every save: at most one save is in flight, so one snapshot is enough.

The tensors come out in the order and under the names of the synchronous save
(`sharded.rank_tensors`: the flat state in `flat_names` order, then the owned parameters' state, which
is small beside it and is copied as it is at the capture), so both write the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import torch

from zerorun.runtime.checkpoint.safetensors_writer import Source
from zerorun.runtime.offload.homes import ADAM_KINDS, MASTER, Home
from zerorun.runtime.offload.nvme import aligned_empty
from zerorun.runtime.store import flat_names

Owned = Callable[[], dict[str, torch.Tensor]]  # the owned parameters' state tensors, by name (optim/update.py)

STREAM_CHUNK = 1 << 24  # fp32 elements per NVMe read (64 MiB), a multiple of the 4096-byte O_DIRECT block


def snapshot_bytes(numels: list[int], streamed: bool, kinds: list[tuple[str, ...]] | None = None) -> int:
    """Host bytes a background save keeps for a rank whose flat state has `numels` elements per group, of `kinds`
    per group (default: Adam's master and two moments): the whole flat state, or one streaming chunk when it is
    `streamed` from NVMe (`zerorun estimate` counts the same)."""
    if streamed:
        return 4 * max(1, min(STREAM_CHUNK, max(numels, default=1)))
    kinds = kinds if kinds is not None else [(MASTER, *ADAM_KINDS)] * len(numels)
    return sum(4 * n * len(k) for n, k in zip(numels, kinds))


def _names(numels: list[int], kinds: list[tuple[str, ...]]) -> list[tuple[str, int, str, int]]:
    """(tensor name, group, kind, numel) in the rank file's order (`flat_names`)."""
    return [(name, g, kind, numels[g]) for name, g, kind in flat_names(kinds)]


class RankState:
    """A rank that writes no state (stage 0 keeps one copy, on rank 0): nothing to capture."""

    streams = False  # True: the capture happens while the file is written
    nbytes = 0  # host bytes held between saves

    def ready_event(self) -> Any:
        """Recorded on the training thread at the save; the capture starts after it (CUDA only)."""
        return None

    def capture(self, ready: Any) -> None:
        """On the writer thread: take the state as it was at `ready`."""

    def sources(self) -> list[Source]:
        return []


class HostSnapshot(RankState):
    """A host copy of this rank's flat state per group and kind, and of its owned parameters' state."""

    def __init__(self, home: Home, numels: list[int], device: torch.device, owned: Owned) -> None:
        self.home, self.owned = home, owned
        pin = device.type == "cuda" and torch.cuda.is_available()
        names = _names(numels, [home.kinds(g) for g in range(len(numels))])
        # one aligned buffer, the tensors back to back as in the rank file (whose data starts aligned):
        # every tensor's address and file offset agree modulo the O_DIRECT block, so it is written in place
        whole = aligned_empty(sum(n for *_, n in names), torch.float32, pin=pin)
        self.buffers = dict(zip([name for name, *_ in names], whole.split([n for *_, n in names])))
        self._where = {name: (g, kind) for name, g, kind, _ in names}
        self._owned: dict[str, torch.Tensor] = {}
        self.side = torch.cuda.Stream(device) if pin else None
        self.nbytes = 4 * whole.numel()

    @staticmethod
    def bytes_for(numels: list[int], kinds: list[tuple[str, ...]]) -> int:
        return snapshot_bytes(numels, streamed=False, kinds=kinds)

    def ready_event(self) -> Any:
        if self.side is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def capture(self, ready: Any) -> None:
        with torch.cuda.stream(self.side) if self.side is not None else contextlib.nullcontext():
            if ready is not None and self.side is not None:
                self.side.wait_event(ready)
            for name, buffer in self.buffers.items():
                group, kind = self._where[name]
                self.home.read(group, kind, buffer)
            self._owned = {name: t.to("cpu", copy=True) for name, t in self.owned().items()}
            if self.side is not None:
                self.side.synchronize()

    def sources(self) -> list[Source]:
        return [Source.of(name, t) for name, t in (*self.buffers.items(), *self._owned.items())]


class StreamedState(RankState):
    """An NVMe home's state, read into the rank file one chunk at a time by the writer."""

    streams = True

    def __init__(self, home: Home, numels: list[int], owned: Owned) -> None:
        self.home, self.numels, self.owned = home, numels, owned
        self.nbytes = self.bytes_for(numels, [])
        self.buffer = aligned_empty(self.nbytes // 4, torch.float32)

    @staticmethod
    def bytes_for(numels: list[int], kinds: list[tuple[str, ...]]) -> int:
        return snapshot_bytes(numels, streamed=True)

    def sources(self) -> list[Source]:
        kinds = [self.home.kinds(g) for g in range(len(self.numels))]
        flat = [Source(name, torch.float32, [n], functools.partial(self._chunks, g, kind, n))
                for name, g, kind, n in _names(self.numels, kinds)]
        return flat + [Source.of(name, t.to("cpu")) for name, t in self.owned().items()]

    def _chunks(self, group: int, kind: str, numel: int) -> Iterator[torch.Tensor]:
        step = self.buffer.numel()
        for lo in range(0, numel, step):
            view = self.buffer[:min(numel, lo + step) - lo]
            self.home.read(group, kind, view, start=lo)
            yield view  # written before the next read reuses the buffer
