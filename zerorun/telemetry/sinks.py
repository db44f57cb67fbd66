"""Where else telemetry goes: TensorBoard event files and CSV, written by the launcher as records arrive.

    collector.sinks = open_sinks(recipe.telemetry, Path("runs/gpt"), job_id)   # before collector.start()

Workers never pay for these: the launcher writes them from the telemetry stream, on the
collector's thread, so they are live (TensorBoard shows a running job) and hold the same numbers
as `telemetry.jsonl` and `zerorun report`'s plots (`series`).

- `telemetry.tensorboard: true` -> `runs/<name>/tensorboard/<job id>/`, through
  `torch.utils.tensorboard.SummaryWriter` (needs the `tensorboard` package, the `tensorboard`
  extra). Per rank, at each step: `loss/rank<r>`, `tokens_per_s/rank<r>`, `step_time_s/rank<r>`,
  `tflops/rank<r>`, `grad_norm/rank<r>`, `loss_scale/rank<r>`, and `loss/mean` over the ranks once
  all of them reported the step; per sample: `memory/device_bytes/rank<r>`,
  `memory/model_state_bytes/rank<r>`, `memory/rss/rank<r>`, at the rank's latest step.
- `telemetry.csv: true` -> `runs/<name>/csv/<job id>/steps.csv` and `samples.csv`, one row per
  record, the columns of `series.STEP_COLUMNS` and `series.SAMPLE_COLUMNS`.
A sink that fails (a full disk) is dropped with one warning; it never ends the job.
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

from zerorun.config import TelemetryConfig
from zerorun.errors import ConfigError
from zerorun.telemetry.series import SAMPLE_COLUMNS, STEP_COLUMNS, sample_row, step_row

TB_STEP_SCALARS = ("loss", "tokens_per_s", "step_time_s", "tflops", "grad_norm", "loss_scale")
TB_SAMPLE_SCALARS = (("device_bytes", "memory/device_bytes"), ("model_state_bytes", "memory/model_state_bytes"),
                     ("rss", "memory/rss"))


def open_sinks(telemetry: TelemetryConfig, run_dir: Path, job_id: str,
               world_size: int) -> tuple[list[Any], list[tuple[str, Exception]]]:
    """The sinks the recipe asks for, open, and (name, error) for those that could not be opened.

    Raises ConfigError when the recipe asks for TensorBoard and it is not installed: that is the
    user's to fix before the job starts, not a warning to miss."""
    sinks: list[Any] = []
    errors: list[tuple[str, Exception]] = []
    wanted = [(TensorBoardSink, run_dir / "tensorboard" / job_id)] if telemetry.tensorboard else []
    wanted += [(CsvSink, run_dir / "csv" / job_id)] if telemetry.csv else []
    for kind, directory in wanted:
        try:
            sinks.append(kind(directory, world_size))
        except OSError as exc:
            errors.append((str(directory), exc))
    return sinks, errors


class CsvSink:
    """steps.csv and samples.csv of one job."""

    name = "CSV"

    def __init__(self, directory: Path, world_size: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._files: list[IO[str]] = []
        self._steps = self._writer("steps.csv", STEP_COLUMNS)
        self._samples = self._writer("samples.csv", SAMPLE_COLUMNS)

    def _writer(self, name: str, columns: tuple[str, ...]) -> csv.DictWriter:
        file = open(self.directory / name, "w", newline="")  # noqa: SIM115 - closed in close()
        self._files.append(file)
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        return writer

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "step":
            self._steps.writerow(step_row(record))
        elif kind == "sample":
            self._samples.writerow(sample_row(record))
        else:
            return
        for file in self._files:
            file.flush()  # a running job's CSV is readable as it goes

    def close(self) -> None:
        for file in self._files:
            file.close()


class TensorBoardSink:
    """One TensorBoard run per job."""

    name = "TensorBoard"

    def __init__(self, directory: Path, world_size: int) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError("telemetry.tensorboard: true needs the tensorboard package: "
                              "pip install 'zerorun[tensorboard]' (or pip install tensorboard).") from None
        self.directory = directory
        self.world_size = world_size
        self._writer = SummaryWriter(log_dir=str(directory))
        self._step_of: dict[int, int] = {}  # rank -> its latest step, where its samples go
        self._losses: dict[int, list[float]] = defaultdict(list)  # step -> the ranks' losses so far

    def add(self, record: dict[str, Any]) -> None:
        kind, rank, t = record.get("type"), record.get("rank"), record.get("t")
        if kind == "step" and isinstance(rank, int):
            step = int(record["step"])
            self._step_of[rank] = step
            for key in TB_STEP_SCALARS:
                if record.get(key) is not None:
                    self._writer.add_scalar(f"{key}/rank{rank}", record[key], step, walltime=t)
            self._mean_loss(step, record.get("loss"), t)
        elif kind == "sample" and isinstance(rank, int):
            row = sample_row(record)
            for column, tag in TB_SAMPLE_SCALARS:
                if row[column] is not None:
                    self._writer.add_scalar(f"{tag}/rank{rank}", row[column], self._step_of.get(rank, 0), walltime=t)

    def _mean_loss(self, step: int, loss: float | None, t: float | None) -> None:
        if loss is None:
            return
        losses = self._losses[step]
        losses.append(float(loss))
        if len(losses) == self.world_size:
            self._writer.add_scalar("loss/mean", sum(losses) / len(losses), step, walltime=t)
            del self._losses[step]

    def close(self) -> None:
        self._writer.close()
