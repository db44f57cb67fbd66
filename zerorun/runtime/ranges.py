"""zerorun's phases as named ranges in a torch.profiler trace, while a profile window records.

    with self.ranges.named("optimizer"):  # "zerorun.optimizer" in the trace (Perfetto, chrome://tracing)
        update.run(...)

| range                         | where                                              |
|-------------------------------|----------------------------------------------------|
| forward, backward, step       | the engine's phases (`TrainingPhase.running`)      |
| optimizer, publish            | inside a step: the Adam pass, the parameters' way back to every rank |
| reduce-scatter / all-reduce   | a unit's gradient collective launched (`... wait`: waited for) |
| all-gather                    | stage 3: a unit gathered (`... wait`: waited for)  |
| offload copies                | the optimizer's tiles moved between device and host (optim/update.py: `OffloadCopies`) |
| overlap update / rollback     | `zero.overlap_optimizer`: a unit's host update under the backward (its worker thread), a speculation undone |
| checkpoint snapshot           | `save_checkpoint` on the training thread: the snapshot (or a whole synchronous save) |

A range costs an operator call, so outside a window `named` returns one shared no-op context: the
telemetry's profile window (telemetry/profile.py) switches its engine's `Ranges` on and off. One `Ranges` per
runtime (runtime/context.py), handed to every part of an engine that names a range, its worker threads included.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

PREFIX = "zerorun."
_OFF: ContextManager[None] = contextlib.nullcontext()


class Ranges:
    """The switch of one runtime's ranges: off until a profile window records."""

    def __init__(self) -> None:
        self.recording = False

    def record(self, on: bool) -> None:
        """Start or stop emitting ranges (the profile window does, around the steps it records)."""
        self.recording = on

    def named(self, name: str) -> ContextManager[object]:
        """A range called `zerorun.<name>` while recording; nothing otherwise."""
        if not self.recording:
            return _OFF
        return torch.profiler.record_function(PREFIX + name)
