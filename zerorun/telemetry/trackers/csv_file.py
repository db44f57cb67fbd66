"""`telemetry.csv: true`: runs/<name>/csv/<job id>/steps.csv and samples.csv, one row per record.

The columns are `series.STEP_COLUMNS` and `series.SAMPLE_COLUMNS`, the same numbers as
`telemetry.jsonl` and `zerorun report`'s plots. Each file is flushed after every record, so a
running job's CSV is readable as it goes.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import IO, Any

from zerorun.telemetry.series import SAMPLE_COLUMNS, STEP_COLUMNS, sample_row, step_row


class CsvTracker:
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
