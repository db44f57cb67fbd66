"""Per-step metrics the engine publishes, for whoever listens (the telemetry probe, tests, user code).

The engine calls its runtime's `events.emit(StepStats)` after every optimizer step (runtime/context.py:
`context.current().events.subscribe(listener)` listens to the engines of this thread's runtime); listeners must be cheap and must
not raise (an exception in a listener is logged and the listener dropped, never propagated into
training). The loss is left as a detached tensor so that nothing here forces a device sync:
a listener on another thread converts it when it sends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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


@dataclass
class CheckpointStats:
    """What one checkpoint save cost this rank (telemetry's `checkpoint` record: these fields, flat)."""

    tag: str
    step: int  # global step saved
    mode: str  # "async", "sync", or "sync-fallback" (the host could not hold the snapshot)
    stall_s: float  # seconds the training loop waited for this save (the previous one's wait included)
    waited_s: float  # of which: seconds it waited for the previous save to commit
    write_s: float  # seconds the background write took (0 for a synchronous save: it is all stall)
    bytes: int  # bytes this rank wrote
    snapshot_bytes: int  # host memory the snapshot holds (kept between saves)


@dataclass
class EngineSetup:
    """An engine's setup starting (`done` False) or finished (`done` True): what process-wide tuning follows."""

    done: bool
    host_memory: str  # zero.host_memory: "fast" or "lean"
    stage: int
    device_type: str  # "cpu", "cuda"


class Events:
    """The listeners of one runtime (runtime/context.py): its engines' steps, checkpoints and setups."""

    def __init__(self) -> None:
        self._steps: list[Callable[[StepStats], None]] = []
        self._checkpoints: list[Callable[[CheckpointStats], None]] = []
        self._setups: list[Callable[[EngineSetup], None]] = []

    def subscribe(self, listener: Callable[[StepStats], None]) -> Callable[[], None]:
        """Call `listener` after every optimizer step; returns a function that unsubscribes."""
        return _add(self._steps, listener)

    def subscribe_checkpoints(self, listener: Callable[[CheckpointStats], None]) -> Callable[[], None]:
        """Call `listener` once per checkpoint save, when it is committed (on the training thread)."""
        return _add(self._checkpoints, listener)

    def subscribe_setup(self, listener: Callable[[EngineSetup], None]) -> Callable[[], None]:
        """Call `listener` when an engine starts and finishes building (the worker's host-memory tuning)."""
        return _add(self._setups, listener)

    def emit(self, stats: StepStats) -> None:
        _notify(self._steps, stats)

    def emit_checkpoint(self, stats: CheckpointStats) -> None:
        _notify(self._checkpoints, stats)

    def emit_setup(self, setup: EngineSetup) -> None:
        _notify(self._setups, setup)


def _add(listeners: list, listener: Callable) -> Callable[[], None]:
    listeners.append(listener)
    return lambda: listeners.remove(listener) if listener in listeners else None


def _notify(listeners: list, value: object) -> None:
    for listener in list(listeners):
        try:
            listener(value)
        except Exception:  # noqa: BLE001 - telemetry must never break training
            log.exception("zerorun: listener %r failed and was removed", listener)
            listeners.remove(listener)


class StepWindow:
    """Accumulates what the micro-steps of one optimizer step did, for `events.StepStats`."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.started = time.perf_counter()
        self.losses: list[torch.Tensor] = []  # as handed to backward; `scalings`: (constant factor, from a forward's)
        self.scalings: list[tuple[float, bool]] = []
        self.samples = 0
        self.tokens = 0
        self.outputs: list[int] = []  # the autograd nodes of the recent forwards' scalar outputs (ids: `note_outputs`)

    def note_outputs(self, out: Any) -> None:
        """Remember the forward's scalar outputs (a loss the model computed), so that `add_loss` reports that loss
        and not the one the script scaled from it (`engine.backward(loss / W)`, `loss * W`)."""
        if torch.is_grad_enabled():
            values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else (out,)
            self.outputs = [*self.outputs, *(id(t.grad_fn) for t in values if _scalar_loss(t))][-8:]

    def count_inputs(self, args: tuple, kwargs: dict, tokens_per_sample: int | None) -> None:
        """Samples = the first tensor's batch dimension; tokens = its numel when it holds token ids.
        A forward under no_grad (a validation pass, generation) is not training: it counts nothing."""
        if not torch.is_grad_enabled():
            return
        first = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.ndim > 0), None)
        if first is None:
            return
        samples = first.shape[0]
        self.samples += samples
        if tokens_per_sample is not None:
            self.tokens += samples * tokens_per_sample
        elif not first.is_floating_point() and first.ndim >= 2:
            self.tokens += first.numel()

    def add_loss(self, loss: torch.Tensor) -> None:
        """The loss as the script computed it, before it scaled it by constants for the backward: down to a scalar
        the forward returned, or else by 1/W in a window of W backwards (`engine.backward(loss / W)`; `close`)."""
        factor, anchored = _scaled_by(loss, set(self.outputs))
        self.losses.append(loss.detach())
        self.scalings.append((factor, anchored))
        self.outputs = []

    def _unscaled(self) -> list[torch.Tensor]:
        window = len(self.losses)
        return [loss if factor == 1.0 or not (anchored or abs(factor * window - 1.0) < 1e-6) else loss / factor
                for loss, (factor, anchored) in zip(self.losses, self.scalings)]

    def close(self, step: int, norm: float, scale: float, skipped: bool, skipped_total: int,
              comm: dict[str, dict[str, float]], offload: dict[str, dict[str, float]]) -> StepStats:
        now = time.perf_counter()
        loss = torch.stack(self._unscaled()).float().mean() if self.losses else None
        stats = StepStats(step, loss, norm, scale, skipped, skipped_total, now - self.started,
                                 self.samples, self.tokens, comm, offload)
        self._reset()
        return stats


def _scalar_loss(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point() and \
        value.grad_fn is not None


_PASS_THROUGH = {"ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0"}


def _scaled_by(loss: torch.Tensor, outputs: set[int]) -> tuple[float, bool]:
    """(the constant `loss` is a value multiplied by, following products and quotients with constants and casts back
    from it; whether that value is one of the forward's scalar outputs, by its node's id in `outputs`)."""
    node, factor = loss.grad_fn, 1.0
    for _ in range(16):
        if node is None or id(node) in outputs:
            return factor, node is not None
        name = type(node).__name__
        inputs = [fn for fn, _ in node.next_functions]
        if name in _PASS_THROUGH and len(inputs) == 1:
            node = inputs[0]
            continue
        if name not in ("MulBackward0", "DivBackward0") or len(inputs) != 2 or (inputs[0] is None) == (inputs[1] is None):
            break
        constant = getattr(node, "_saved_other" if inputs[1] is None else "_saved_self", None)
        if not isinstance(constant, torch.Tensor) or constant.numel() != 1 or (name == "DivBackward0" and inputs[0] is None):
            break  # a constant divided by the loss is not a scaling of it
        value = float(constant)
        if value == 0.0:
            break
        factor = factor / value if name == "DivBackward0" else factor * value
        node = inputs[0] if inputs[0] is not None else inputs[1]
    return factor, False
