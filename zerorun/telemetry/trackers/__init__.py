"""Where else telemetry goes: TensorBoard, CSV, Weights & Biases and MLflow, written by the launcher.

    trackers, errors = open_trackers(recipe.telemetry, Path("runs/gpt"), job_id, world_size, recipe_data)

Workers never pay for these and hold no tracker code: the launcher writes them from the telemetry
stream as records arrive, so they are live and hold the same numbers as `telemetry.jsonl` and
`zerorun report`'s plots. Each is a `Tracker` (`base.py`): `add(record)` for every record, `close()`
at the end. A tracker that cannot start or fails later is one warning, never the job's exit code;
only TensorBoard, which writes local files the user asked for, refuses to start without its package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from zerorun.config import TelemetryConfig
from zerorun.telemetry.trackers.base import Background, Tracker, TrackerUnavailable
from zerorun.telemetry.trackers.csv_file import CsvTracker
from zerorun.telemetry.trackers.tensorboard import TensorBoardTracker

__all__ = ["Tracker", "TrackerUnavailable", "open_trackers"]


def open_trackers(telemetry: TelemetryConfig, run_dir: Path, job_id: str, world_size: int,
                  recipe: dict[str, Any] | None = None) -> tuple[list[Tracker], list[tuple[str, Exception]]]:
    """The trackers the recipe asks for, started, and (name, error) for those that could not start.

    W&B and MLflow start on their own threads (their imports and first calls take seconds and may
    wait on a network); `recipe` becomes the run's config there."""
    trackers: list[Tracker] = []
    errors: list[tuple[str, Exception]] = []
    wanted: list[tuple[str, Any]] = []
    if telemetry.tensorboard:
        wanted.append(("TensorBoard", lambda: TensorBoardTracker(run_dir / "tensorboard" / job_id, world_size)))
    if telemetry.csv:
        wanted.append(("CSV", lambda: CsvTracker(run_dir / "csv" / job_id, world_size)))
    if telemetry.wandb:
        wanted.append(("Weights & Biases", lambda: _service("wandb", "Weights & Biases", lambda: _wandb(
            run_dir, job_id, world_size, recipe))))
    if telemetry.mlflow:
        wanted.append(("MLflow", lambda: _service("mlflow", "MLflow", lambda: _mlflow(
            run_dir, job_id, world_size, recipe))))
    for name, start in wanted:
        try:
            trackers.append(start())
        except (OSError, TrackerUnavailable) as exc:
            errors.append((name, exc))
    return trackers, errors


def _service(module: str, name: str, open_tracker: Any) -> Background:
    if not _importable(module):
        raise TrackerUnavailable(f"{module} is not installed: pip install 'zerorun[{module}]'")
    return Background(name, f"{name} (starting)", open_tracker)


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None  # None: imports of it are blocked
    return importlib.util.find_spec(module) is not None


def _wandb(run_dir: Path, job_id: str, world_size: int, recipe: dict[str, Any] | None) -> Tracker:
    from zerorun.telemetry.trackers.wandb_tracker import WandbTracker

    return WandbTracker(run_dir, job_id, world_size, recipe or {})


def _mlflow(run_dir: Path, job_id: str, world_size: int, recipe: dict[str, Any] | None) -> Tracker:
    from zerorun.telemetry.trackers.mlflow_tracker import MlflowTracker

    return MlflowTracker(run_dir, job_id, world_size, recipe or {})
