"""`telemetry.tensorboard: true`: event files in runs/<name>/tensorboard/<job id>/.

Through `torch.utils.tensorboard.SummaryWriter` (the `tensorboard` package, the `tensorboard`
extra). Per rank, at each step: `loss/rank<r>`, `tokens_per_s/rank<r>`, `step_time_s/rank<r>`,
`tflops/rank<r>`, `grad_norm/rank<r>`, `loss_scale/rank<r>`, `lr/rank<r>`, and `loss/mean` over
the ranks once all of them reported the step; per sample: `memory/device_bytes/rank<r>`,
`memory/model_state_bytes/rank<r>`, `memory/rss/rank<r>`, at the rank's latest step.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

from zerorun.errors import ConfigError
from zerorun.telemetry.series import sample_row

TB_STEP_SCALARS = ("loss", "tokens_per_s", "step_time_s", "tflops", "grad_norm", "loss_scale", "lr")
TB_SAMPLE_SCALARS = (("device_bytes", "memory/device_bytes"), ("model_state_bytes", "memory/model_state_bytes"),
                     ("rss", "memory/rss"))


class TensorBoardTracker:
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
