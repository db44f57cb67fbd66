"""`telemetry.mlflow: true`: one MLflow run per job, the recipe as its parameters and an artifact.

MLflow reads its own environment: `MLFLOW_TRACKING_URI` says where runs go (a server, a database,
a local folder), `MLFLOW_EXPERIMENT_NAME` the experiment (else the run name). The run is named
after the job id; metrics (`metrics.py`) go in batches, at most every `FLUSH_S` seconds or
`FLUSH_METRICS` metrics, so a remote server gets few requests; the run ends FINISHED, or FAILED
with the job's exit code as a tag.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from zerorun.telemetry.trackers.metrics import Metrics

FLUSH_S = 2.0
FLUSH_METRICS = 1000  # MLflow's limit for one batch
PARAM_CHARS = 500  # the value length every MLflow store accepts


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Dotted keys and their values as text: `{"zero": {"stage": 2}}` -> `{"zero.stage": "2"}`."""
    out: dict[str, str] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = str(value)[:PARAM_CHARS]
    return out


class MlflowTracker:
    name = "MLflow"

    def __init__(self, run_dir: Path, job_id: str, world_size: int, recipe: dict[str, Any]) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient()
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run_dir.name
        experiment = client.get_experiment_by_name(experiment_name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(experiment_name)
        self._run_id = client.create_run(experiment_id, run_name=job_id, tags={"zerorun.job_id": job_id}).info.run_id
        params = [Param(key, value) for key, value in flatten(recipe).items()]
        for start in range(0, len(params), 100):
            client.log_batch(self._run_id, params=params[start:start + 100])
        client.log_dict(self._run_id, recipe, "recipe.json")
        self.directory: Path | str = f"{client.tracking_uri} run {self._run_id}"
        self._metrics = Metrics(world_size)
        self._buffer: list[Any] = []
        self._flushed_at = time.monotonic()
        self._exit_code = 0

    def add(self, record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        if record.get("type") == "end":
            self._exit_code = int(record.get("exit_code") or 0)
        for point in self._metrics.add(record):
            stamp = int((point.t or time.time()) * 1000)
            self._buffer += [Metric(key, value, stamp, point.step) for key, value in point.values.items()
                             if math.isfinite(value)]
        if len(self._buffer) >= FLUSH_METRICS or time.monotonic() - self._flushed_at >= FLUSH_S:
            self._flush()

    def _flush(self) -> None:
        while self._buffer:
            batch, self._buffer = self._buffer[:FLUSH_METRICS], self._buffer[FLUSH_METRICS:]
            self._client.log_batch(self._run_id, metrics=batch)
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        self._flush()
        if self._exit_code:
            self._client.set_tag(self._run_id, "zerorun.exit_code", str(self._exit_code))
        self._client.set_terminated(self._run_id, status="FAILED" if self._exit_code else "FINISHED")
