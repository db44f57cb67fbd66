"""Trackers: the metrics they log, a failing tracker as one warning, and real W&B and MLflow runs.

The real runs need the libraries (`pip install 'zerorun[wandb,mlflow]'`, which CI installs) and skip
cleanly without them; W&B runs offline and MLflow on a local file store, and the values are read
back with each library's own reader. A job whose trackers cannot even be imported warns once per
tracker and exits 0.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch.launched import subprocess_env, write_recipe
from zerorun.telemetry.trackers.base import Background
from zerorun.telemetry.trackers.metrics import Metrics

TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")


def step(rank: int, n: int, loss: float, comm: float = 0.0) -> dict:
    return {"type": "step", "rank": rank, "step": n, "t": 1.0 + n, "loss": loss, "lr": 0.1 * n, "grad_norm": 2.0,
            "loss_scale": 1.0, "step_time_s": 0.5, "tokens_per_s": 100.0,
            "comm": {"all_reduce": {"waited": comm, "seconds": comm, "bytes": 8}}, "offload": {}}


def test_metrics_give_the_job_s_loss_once_every_rank_reported_and_each_step_s_phases() -> None:
    metrics = Metrics(world_size=2)
    (first,) = metrics.add(step(0, 1, 2.0, comm=0.1))
    assert first.step == 1 and "loss" not in first.values  # rank 1 has not reported step 1 yet
    assert first.values["lr"] == pytest.approx(0.1) and first.values["loss/rank0"] == 2.0
    assert first.values["phase/comm_wait_s/rank0"] == pytest.approx(0.1)
    assert first.values["phase/compute_s/rank0"] == pytest.approx(0.4)
    (second,) = metrics.add(step(1, 1, 4.0))
    assert second.values["loss"] == 3.0 and second.values["tokens_per_s"] == 200.0 and "lr" not in second.values
    (third,) = metrics.add(step(0, 2, 1.0, comm=0.3))  # counters are cumulative: this step waited 0.2
    assert third.values["phase/comm_wait_s/rank0"] == pytest.approx(0.2)
    (sample,) = metrics.add({"type": "sample", "rank": 1, "t": 5.0, "rss": 1000, "memory": None, "cuda": None})
    assert sample.step == 1 and sample.values == {"memory/rss_bytes/rank1": 1000}
    (restart,) = metrics.add({"type": "restart", "attempt": 1, "world_size": 1, "t": 6.0})
    assert restart.values == {"restarts": 1.0} and restart.step == 1
    assert metrics.add({"type": "hello", "rank": 0}) == []


class Failing:
    name, directory = "failing", "nowhere"

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def add(self, record: dict) -> None:
        self.seen.append(record)
        if len(self.seen) == 2:
            raise ConnectionError("no network")

    def close(self) -> None:
        pass


def test_a_tracker_that_fails_stops_and_raises_its_first_error_without_blocking_the_stream() -> None:
    tracker = Failing()
    background = Background("failing", "nowhere", lambda: tracker)
    background.add({"type": "a"})
    background.add({"type": "b"})
    deadline = time.monotonic() + 10
    with pytest.raises(ConnectionError, match="no network"):
        while time.monotonic() < deadline:  # the thread fails on the second record; add says so from then on
            background.add({"type": "c"})
            time.sleep(0.01)
    assert len(tracker.seen) == 2


def test_a_tracker_that_cannot_start_raises_its_error_from_add_or_close() -> None:
    def cannot() -> Failing:
        raise PermissionError("bad credentials")

    background = Background("x", "nowhere", cannot)
    with pytest.raises(PermissionError, match="bad credentials"):
        background.add({"type": "a"})  # raises already if the thread has failed by now
        background.close()


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]


def _mean_losses(records: list[dict]) -> dict[int, float]:
    by_step: dict[int, list[float]] = {}
    for r in records:
        if r["type"] == "step":
            by_step.setdefault(r["step"], []).append(r["loss"])
    return {s: sum(v) / len(v) for s, v in by_step.items()}


def _launch(tmp_path: Path, env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess[str]:
    recipe = write_recipe(tmp_path, TINY, nproc_per_node=2, train={"steps": 6},
                          telemetry={"interval_s": 0.1, "wandb": True, "mlflow": True})
    code = f"import sys; {prelude}from zerorun.cli import main; sys.argv = ['zerorun', 'launch', {str(recipe)!r}]; main()"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**subprocess_env(), **env})


@pytest.mark.slow
def test_wandb_offline_and_mlflow_on_a_local_store_record_every_step_s_loss(tmp_path: Path) -> None:
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb-dir"), "WANDB_PROJECT": "zr-test",
           "WANDB_SILENT": "true", "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    result = _launch(tmp_path, env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "warning" not in result.stderr, result.stderr
    records = _records(tmp_path / "runs" / "recipe")
    job_id, losses = records[0]["job_id"], _mean_losses(records)
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([client.get_experiment_by_name("recipe").experiment_id])
    assert run.info.run_name == job_id and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "6" and run.data.params["nproc_per_node"] == "2"
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    assert history == pytest.approx(losses, rel=1e-6)
    assert {m.step for m in client.get_metric_history(run.info.run_id, "lr")} == set(losses)
    assert client.get_metric_history(run.info.run_id, "memory/rss_bytes/rank1")[-1].value > 0

    (offline,) = (tmp_path / "wandb-dir" / "wandb").glob(f"offline-run-*-{job_id}")
    records = _wandb_records(next(offline.glob("*.wandb")))
    history = _wandb_history(records)
    logged = {int(row["step"]): row["loss"] for row in history if "loss" in row}
    assert logged == pytest.approx(losses, rel=1e-6)
    assert any("phase/compute_s/rank0" in row for row in history)
    (run_record,) = [r.run for r in records if r.WhichOneof("record_type") == "run"][:1]
    config = {item.key: json.loads(item.value_json) for item in run_record.config.update}
    assert run_record.project == "zr-test" and config["train"]["steps"] == 6  # the recipe is the config


def _wandb_records(path: Path) -> list:
    """The records of an offline W&B run (wandb's protobufs in its LevelDB-style log: 32 KiB blocks,
    each chunk behind a 7-byte header of CRC, length and type; full, or first/middle/last pieces)."""
    from wandb.proto import wandb_internal_pb2

    data, records, pending, index = path.read_bytes(), [], b"", 7  # 7: the file's own header, ":W&B" ...
    assert data[:4] == b":W&B"
    while index + 7 <= len(data):
        if 32768 - index % 32768 < 7:
            index += 32768 - index % 32768  # a block's tail too short for a header is padding
            continue
        length, kind = struct.unpack("<HB", data[index + 4:index + 7])
        chunk, index = data[index + 7:index + 7 + length], index + 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # full, or the last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def _wandb_history(records: list) -> list[dict]:
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]


@pytest.mark.slow
def test_without_either_library_the_job_warns_once_per_tracker_and_exits_0(tmp_path: Path) -> None:
    result = _launch(tmp_path, {}, prelude="sys.modules['wandb'] = None; sys.modules['mlflow'] = None; ")
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 2, result.stderr
    assert "Weights & Biases (wandb is not installed: pip install 'zerorun[wandb]')" in warnings[0]
    assert "MLflow (mlflow is not installed: pip install 'zerorun[mlflow]')" in warnings[1]
    assert "6/6 steps" in result.stderr

