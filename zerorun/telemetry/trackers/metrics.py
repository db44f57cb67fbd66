"""Telemetry records as the metrics a tracker logs: one small dictionary per step, named once here.

`Metrics.add(record)` turns each record of the stream into zero or more `Point`s (a step, the
launcher's time, and name -> value), the same for every tracker that logs named scalars by step
(Weights & Biases, MLflow):

- `loss`, `tokens_per_s` (the job's: the mean loss and the summed rate once every rank reported
  the step), `lr`, `grad_norm`, `loss_scale` (one job-wide value each: rank 0's);
- per rank `r`: `loss/rank<r>`, `tokens_per_s/rank<r>`, `step_time_s/rank<r>`, `tflops/rank<r>`,
  and the step's phases, `phase/compute_s/rank<r>`, `phase/comm_wait_s/rank<r>` (waiting on
  collectives compute did not hide) and `phase/io_wait_s/rank<r>` (waiting on offload copies and
  NVMe), from the step's cumulative counters;
- per sample, at the rank's latest step: `memory/device_bytes/rank<r>`,
  `memory/model_state_bytes/rank<r>`, `memory/rss_bytes/rank<r>`;
- per restart: `restarts` (the attempt number), at the step the job had reached.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from zerorun.telemetry.series import sample_row, step_row

JOB_WIDE = ("lr", "grad_norm", "loss_scale")  # the same on every rank: logged once, from rank 0
PER_RANK = ("loss", "tokens_per_s", "step_time_s", "tflops")
SAMPLES = (("device_bytes", "memory/device_bytes"), ("model_state_bytes", "memory/model_state_bytes"),
           ("rss", "memory/rss_bytes"))


@dataclass(frozen=True)
class Point:
    step: int
    t: float | None
    values: dict[str, float]


@dataclass
class Metrics:
    world_size: int
    _step_of: dict[int, int] = field(default_factory=dict)  # rank -> its latest step
    _waits: dict[int, tuple[float, float]] = field(default_factory=dict)  # rank -> cumulative (comm, io) waits
    _pending: dict[int, list[tuple[float | None, float | None]]] = field(default_factory=lambda: defaultdict(list))

    def add(self, record: dict[str, Any]) -> list[Point]:
        kind, rank = record.get("type"), record.get("rank")
        if kind == "step" and isinstance(rank, int):
            return self._step(record, rank)
        if kind == "sample" and isinstance(rank, int):
            row = sample_row(record)
            values = {f"{name}/rank{rank}": row[column] for column, name in SAMPLES if row[column] is not None}
            return [Point(self._step_of.get(rank, 0), record.get("t"), values)] if values else []
        if kind == "restart":
            self.world_size = int(record.get("world_size") or self.world_size)  # a shrink changes it
            self._pending.clear()  # a step of the failed attempt will not complete
            self._waits.clear()  # the new processes count from zero
            reached = min(self._step_of.values(), default=0)
            return [Point(reached, record.get("t"), {"restarts": float(record.get("attempt") or 0)})]
        return []

    def _step(self, record: dict[str, Any], rank: int) -> list[Point]:
        row = step_row(record)
        step = int(record["step"])
        self._step_of[rank] = step
        values = {f"{key}/rank{rank}": float(row[key]) for key in PER_RANK if row.get(key) is not None}
        if rank == 0:
            values.update({key: float(record[key]) for key in JOB_WIDE if record.get(key) is not None})
        comm, io = float(row["comm_waited_s"] or 0.0), float(row["offload_waited_s"] or 0.0)
        last_comm, last_io = self._waits.get(rank, (0.0, 0.0))
        self._waits[rank] = (comm, io)
        comm, io = max(0.0, comm - last_comm), max(0.0, io - last_io)
        if row.get("step_time_s") is not None:
            values[f"phase/compute_s/rank{rank}"] = max(0.0, float(row["step_time_s"]) - comm - io)
        values[f"phase/comm_wait_s/rank{rank}"] = comm
        values[f"phase/io_wait_s/rank{rank}"] = io
        self._pending[step].append((row.get("loss"), row.get("tokens_per_s")))
        if len(self._pending[step]) == self.world_size:
            losses = [x for x, _ in self._pending[step] if x is not None]
            rates = [x for _, x in self._pending.pop(step) if x is not None]
            if losses:
                values["loss"] = sum(losses) / len(losses)
            if rates:
                values["tokens_per_s"] = sum(rates)
        return [Point(step, record.get("t"), values)]
