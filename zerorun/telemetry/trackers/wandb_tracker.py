"""`telemetry.wandb: true`: one Weights & Biases run per job, with the recipe as its config.

W&B reads its own environment: `WANDB_MODE=offline` writes the run to disk for a later `wandb
sync`, `WANDB_PROJECT` names the project (else "zerorun"), `WANDB_DIR` the folder (else the run's
folder, runs/<name>/), `WANDB_API_KEY` or `wandb login` the credentials. The run is named after
the job id and grouped by the run name, and its metrics (`metrics.py`) are plotted against `step`,
so the ranks' records may arrive in any order and a resumed attempt's steps go back in place.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zerorun.telemetry.trackers.metrics import Metrics


class WandbTracker:
    name = "Weights & Biases"

    def __init__(self, run_dir: Path, job_id: str, world_size: int, recipe: dict[str, Any]) -> None:
        import wandb

        folder = Path(os.environ.get("WANDB_DIR") or run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "zerorun", name=job_id, id=job_id,
                               group=run_dir.name, job_type="train", config=recipe, dir=str(folder),
                               settings=wandb.Settings(console="off"))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self.directory: Path | str = getattr(self._run, "url", None) or self._run.dir
        self._metrics = Metrics(world_size)
        self._exit_code = 0

    def add(self, record: dict[str, Any]) -> None:
        if record.get("type") == "end":
            self._exit_code = int(record.get("exit_code") or 0)
        for point in self._metrics.add(record):
            self._run.log({**point.values, "step": point.step})

    def close(self) -> None:
        self._run.finish(exit_code=self._exit_code)
