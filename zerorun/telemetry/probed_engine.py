"""What the telemetry probe reads of an engine, written down as a Protocol (runtime/engine.py's `Engine` is
one): a renamed attribute then fails the type check instead of a run's telemetry, and telemetry needs no
import of the runtime."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from zerorun.config import Recipe

if TYPE_CHECKING:
    import torch  # imported where used: the launcher's side of telemetry runs without it


class MemoryFigures(Protocol):
    def as_dict(self) -> dict[str, dict[str, int]]: ...


class CollectivePlace(Protocol):
    def last_collective(self) -> str | None: ...


class ProbedEngine(Protocol):
    """What the probe reads of an engine (runtime/engine.py's `Engine`), written down so that a renamed
    attribute fails the type check instead of a run's telemetry."""

    recipe: Recipe
    device: torch.device
    stage: int
    global_step: int
    resumed_from: str | None

    @property
    def where(self) -> CollectivePlace: ...  # the last collective's place, for the stall report

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def num_parameters(self) -> int: ...

    def memory(self) -> MemoryFigures: ...
