"""A restarted job in the telemetry: what failed, where the next attempt resumed, and how long the gap was.

The launcher writes a `restart` record when it starts an attempt after a failure: the attempt
number, its job id and world size, the failure's cause, the decision (same nodes, or which were
dropped), and three of its own clocks: when the failure was noticed (`failed_at`), when every node
had been torn down (`torn_down_at`), and when the next attempt started (`t`). The workers' records
then add the rest (`RunState` calls `saw`): the first `hello` (processes up, process group
joined), the last `engine` (every rank built its engine and loaded the checkpoint) and the
moment every rank finished its first step. All are the launcher's clock (the collector stamps
worker records on arrival), so the gap adds up without comparing clocks across machines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Restart:
    """One restart and the time from the failure to the first step after it."""

    attempt: int
    cause: str
    decision: str
    world_size: int
    failed_at: float
    torn_down_at: float
    started_at: float
    step_reached: int  # the step every rank had finished when the failure came
    hello_at: float | None = None
    engine_at: float | None = None
    first_step_at: float | None = None
    resumed_at_step: int | None = None  # the engine's global_step after its auto-resume (0: from scratch)
    resumed_from: str | None = None  # the checkpoint tag it loaded
    _engines: set[int] = field(default_factory=set)

    @classmethod
    def from_record(cls, record: dict[str, Any], step_reached: int) -> Restart:
        t = float(record.get("t") or 0.0)
        return cls(int(record.get("attempt") or 0), str(record.get("cause") or ""), str(record.get("decision") or ""),
                   int(record.get("world_size") or 0), float(record.get("failed_at") or t),
                   float(record.get("torn_down_at") or t), t, step_reached)

    def saw(self, record: dict[str, Any], now: float, all_stepped: bool) -> None:
        """A worker record of this attempt, arrived at `now`; `all_stepped`: every rank has finished a step."""
        kind = record.get("type")
        if kind == "hello" and self.hello_at is None:
            self.hello_at = now
        elif kind == "engine" and isinstance(record.get("rank"), int):
            self._engines.add(record["rank"])
            if len(self._engines) >= self.world_size and self.engine_at is None:
                self.engine_at = now
            if record.get("global_step") is not None:
                self.resumed_at_step, self.resumed_from = int(record["global_step"]), record.get("resumed_from")
        elif kind == "step" and all_stepped and self.first_step_at is None:
            self.first_step_at = now

    def gap(self) -> dict[str, float] | None:
        """Seconds from the failure to the first step after the restart, and its parts (None before that step)."""
        if None in (self.hello_at, self.engine_at, self.first_step_at):
            return None
        assert self.hello_at is not None and self.engine_at is not None and self.first_step_at is not None
        return {"total": self.first_step_at - self.failed_at, "teardown": self.torn_down_at - self.failed_at,
                "restart": self.started_at - self.torn_down_at, "start": self.hello_at - self.started_at,
                "engine": self.engine_at - self.hello_at, "first step": self.first_step_at - self.engine_at}

    def describe(self) -> str:
        """One line: the failure, where the next attempt resumed, what was lost, and the gap."""
        where = "from scratch" if not self.resumed_at_step else \
            f"from {self.resumed_from or 'a checkpoint'} at step {self.resumed_at_step}"
        lost = max(0, self.step_reached - (self.resumed_at_step or 0))
        text = f"restart {self.attempt}: {self.cause}; resumed {where}, {lost} step{'s' if lost != 1 else ''} run again"
        gap = self.gap()
        if gap is not None:
            parts = ", ".join(f"{name} {gap[name]:.1f}" for name in ("teardown", "restart", "start", "engine",
                                                                       "first step"))
            text += f"; {gap['total']:.1f} s from the failure to the first step after it ({parts} s)"
        return text
