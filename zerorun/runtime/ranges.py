"""zerorun's phases as named ranges in a torch.profiler trace, while a profile window records.

    with ranges.named("optimizer"):       # "zerorun.optimizer" in the trace (Perfetto, chrome://tracing)
        update.run(...)

| range                         | where                                              |
|-------------------------------|----------------------------------------------------|
| forward, backward, step       | the engine's phases (`TrainingPhase.running`)      |
| optimizer, publish            | inside a step: the Adam pass, the parameters' way back to every rank |
| reduce-scatter / all-reduce   | a unit's gradient collective launched (`... wait`: waited for) |
| all-gather                    | stage 3: a unit gathered (`... wait`: waited for)  |
| offload copies                | the optimizer's tiles moved between device and host (`OffloadCopies`) |
| overlap update / rollback     | `zero.overlap_optimizer`: a unit's host update under the backward (its worker thread), a speculation undone |
| checkpoint snapshot           | `save_checkpoint` on the training thread: the snapshot (or a whole synchronous save) |

A range costs an operator call, so outside a window `named` returns one shared no-op context: the
telemetry's profile window (telemetry/profile.py) switches recording on and off. The switch is
process-wide, as torch.profiler's own state is.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager

import torch

from zerorun.runtime.offload.transfers import Direct, Transfers

PREFIX = "zerorun."
_OFF: ContextManager[None] = contextlib.nullcontext()
_recording = False


def record(on: bool) -> None:
    """Start or stop emitting ranges (the profile window does, around the steps it records)."""
    global _recording
    _recording = on


def recording() -> bool:
    return _recording


def named(name: str) -> ContextManager[object]:
    """A range called `zerorun.<name>` while recording; nothing otherwise."""
    if not _recording:
        return _OFF
    return torch.profiler.record_function(PREFIX + name)


def offload_copies(transfers: Transfers) -> Transfers:
    """`transfers` with each of its copies in an "offload copies" range (unchanged when nothing is offloaded)."""
    return transfers if isinstance(transfers, Direct) else OffloadCopies(transfers)


class OffloadCopies:
    """A `Transfers` that puts the optimizer's device/host copies in ranges, and delegates everything."""

    def __init__(self, inner: Transfers) -> None:
        self.inner = inner

    def begin(self, grad_tiles: list[torch.Tensor], after: Any = None) -> None:
        with named("offload copies"):
            self.inner.begin(grad_tiles, after)

    def fetch(self, k: int) -> torch.Tensor:
        with named("offload copies"):
            return self.inner.fetch(k)

    def reaches(self, dest: torch.Tensor) -> bool:
        return self.inner.reaches(dest)

    def out_slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.inner.out_slot(numel, dtype)

    def send(self, dest: torch.Tensor, staged: torch.Tensor) -> None:
        with named("offload copies"):
            self.inner.send(dest, staged)

    def finish(self) -> None:
        with named("offload copies"):
            self.inner.finish()

    def held_bytes(self) -> int:
        return self.inner.held_bytes()

    def stats(self) -> dict[str, dict[str, float]]:
        return self.inner.stats()
