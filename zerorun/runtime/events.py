"""Per-step metrics the engine publishes, for whoever listens (the telemetry probe, tests, user code).

The engine calls `emit(StepStats)` after every optimizer step; listeners must be cheap and must
not raise (an exception in a listener is logged and the listener dropped, never propagated into
training). The loss is left as a detached tensor so that nothing here forces a device sync:
a listener on another thread converts it when it sends.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger("zerorun")


@dataclass
class StepStats:
    """What one optimizer step did, on this rank."""

    step: int  # global step after this update (1-based)
    loss: torch.Tensor | None  # mean of the micro-batch losses of this step (detached)
    grad_norm: float  # global L2 norm before clipping (inf/nan on overflow)
    loss_scale: float
    skipped: bool  # inf/nan: the update was skipped on every rank
    skipped_total: int
    step_time_s: float  # wall time since the previous step ended (forward + backward + step)
    samples: int  # samples this rank processed in this step
    tokens: int  # tokens this rank processed in this step
    comm: dict[str, dict[str, float]] = field(default_factory=dict)  # cumulative per collective kind
    # cumulative offload traffic: d2h / h2d (device <-> host), nvme_read / nvme_write: bytes and seconds in
    # flight; wait: seconds the step blocked on transfers or I/O
    offload: dict[str, dict[str, float]] = field(default_factory=dict)


_listeners: list[Callable[[StepStats], None]] = []


def subscribe(listener: Callable[[StepStats], None]) -> Callable[[], None]:
    """Call `listener` after every optimizer step; returns a function that unsubscribes."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener) if listener in _listeners else None


def emit(stats: StepStats) -> None:
    for listener in list(_listeners):
        try:
            listener(stats)
        except Exception:  # noqa: BLE001 - telemetry must never break training
            log.exception("zerorun: step listener %r failed and was removed", listener)
            _listeners.remove(listener)
