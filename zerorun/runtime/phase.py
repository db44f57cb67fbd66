"""The engine's training phase: the one place that says whether forward, backward or a step is running.

The gradient reducer and the stage 3 scheduler both need to know it: a gradient may arrive only
inside `engine.backward`, and a module's forward that runs during backward is activation-checkpoint
recomputation (its parameters must stay gathered), not a new forward. Keeping that bit in each of
them, set by hand in the same order, is how two copies drift; here the engine owns it and they read.

    engine.phase.now                      # Phase.IDLE between calls
    with engine.phase.running(Phase.BACKWARD):
        loss.backward()                   # hooks read engine.phase.now
"""

from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from typing import Iterator

from zerorun.runtime.ranges import Ranges


class Phase(Enum):
    """What the engine is doing right now."""

    IDLE = "idle"  # between calls (a forward called on the module directly also runs in IDLE)
    FORWARD = "forward"  # inside engine(...) / engine.forward(...)
    BACKWARD = "backward"  # inside engine.backward(loss), recomputation included
    STEP = "step"  # inside engine.step()'s optimizer update and publish


class TrainingPhase:
    """The current `Phase`; entering one requires being idle (phases never nest)."""

    def __init__(self, ranges: Ranges | None = None) -> None:
        self.now = Phase.IDLE
        self.ranges = ranges or Ranges()  # the runtime's: each phase, and what the phase's parts do, in a trace

    @contextmanager
    def running(self, phase: Phase) -> Iterator[None]:
        assert phase is not Phase.IDLE, "enter a working phase, not IDLE"
        assert self.now is Phase.IDLE, f"cannot start {phase.value} while {self.now.value} is running"
        self.now = phase
        try:
            with self.ranges.named(phase.value):  # a profile window's trace shows each phase (ranges.py)
                yield
        finally:
            self.now = Phase.IDLE
