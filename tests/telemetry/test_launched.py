"""Real 2-rank CPU launches with telemetry: records, memory, plain output, report, stalls, a killed launcher.

Each test runs `python -m zerorun.cli launch` from a temporary directory (so the run lands in
`tmp_path/runs/recipe/telemetry.jsonl`) with `scripts/tiny_train.py`, and checks afterwards that
no process of the job is left.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from zerorun.cli import app

TINY = str(Path(__file__).parent / "scripts" / "tiny_train.py")
FAST = {"interval_s": 0.1}


def records(tmp_path: Path) -> list[dict]:
    path = tmp_path / "runs" / "recipe" / "telemetry.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def of(recs: list[dict], kind: str, rank: int | None = None) -> list[dict]:
    return [r for r in recs if r["type"] == kind and (rank is None or r.get("rank") == rank)]


@pytest.mark.slow  # a real launch; the collector and console tests stay fast
def test_two_ranks_stream_every_step_memory_equals_engine_memory_plain_summaries_and_report(launch, tmp_path):
    job = launch(TINY, nproc_per_node=2, train={"steps": 5}, telemetry=FAST)
    assert job.wait() == 0, job.output
    recs = records(tmp_path)
    assert recs[0]["type"] == "job" and recs[0]["world_size"] == 2 and recs[0]["steps"] == 5
    assert recs[-1] == {"type": "end", "exit_code": 0, "t": recs[-1]["t"], "job_id": recs[0]["job_id"]}
    assert all(r["job_id"] == recs[0]["job_id"] for r in recs)  # every record says its job: the report never mixes
    assert not any("telemetry: dropped" in line or "did not prove" in line for line in job.stderr), job.output
    pids = set(job.worker_pids())
    for rank in (0, 1):
        (hello,) = of(recs, "hello", rank)
        assert hello["host"] == "localhost" and hello["pid"] in pids
        steps = of(recs, "step", rank)
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
        assert all(s["tokens"] == 36 and s["samples"] == 4 and s["tokens_per_s"] > 0 for s in steps)
        assert all(isinstance(s["loss"], float) and s["tflops"] > 0 and s["mfu"] is None for s in steps)
        (engine,) = of(recs, "engine", rank)
        assert engine["params"] == 64 * 16 + 16 * 64 + 64 and engine["peak_tflops"] is None
        printed = next(line for line in job.stdout if line.startswith(f"[localhost:{rank}] memory "))
        assert of(recs, "sample", rank)[-1]["memory"] == json.loads(printed.split(" memory ", 1)[1])
        assert of(recs, "bye", rank)
    stderr = "\n".join(job.stderr)
    assert "zerorun: step 5/5 (100%)" in stderr  # not a terminal: plain summary lines
    assert "peak RSS" in stderr and "zerorun: telemetry: runs/recipe/telemetry.jsonl" in stderr
    assert job.leftovers() == []

    report = CliRunner().invoke(app, ["report", str(tmp_path / "runs" / "recipe")])
    assert report.exit_code == 0, report.output
    assert f"job {recs[0]['job_id']}: 5/5 steps" in report.output and "exit code 0" in report.output
    assert len([line for line in report.output.splitlines() if "localhost" in line]) == 2


@pytest.mark.slow
def test_a_sleeping_rank_triggers_the_stall_report_with_the_stack_of_the_sleeping_frame(launch, tmp_path):
    job = launch(TINY, ["--sleep-rank", "1", "--sleep-at", "2"], nproc_per_node=2, train={"steps": 50},
                 telemetry={"interval_s": 0.2, "stall_s": 2.0})
    job.wait_for("[localhost:1] sleeping")

    def stacks_from_both_ranks() -> bool:  # faulthandler's lines, relayed; each main thread ends in runpy
        return all(any(line.startswith(f"[localhost:{rank}] ") and line.endswith("in _run_module_as_main")
                       for line in job.stderr) for rank in (0, 1))

    job.wait_until(stacks_from_both_ranks, "both ranks' stacks", timeout=30)
    stderr = "\n".join(job.stderr)
    assert "zerorun: stall: no rank has finished a step for" in stderr
    assert "zerorun: behind: rank 1 on localhost at step 2, in sleep_here (tiny_train.py:" in stderr
    assert "zerorun: waiting for them: rank 0 on localhost at step 2" in stderr
    stack = [line for line in job.stderr if line.startswith("[localhost:1] ")]
    assert any('tiny_train.py", line' in line and line.endswith("in sleep_here") for line in stack)
    assert any(line.startswith("[localhost:0]  ") and 'File "' in line for line in job.stderr)  # rank 0's too
    job.send(signal.SIGINT)
    assert job.wait() == 130, job.output
    assert of(records(tmp_path), "stall")[0]["behind"] == [1]
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_killed_launcher_does_not_leave_workers_hanging(launch, tmp_path):
    job = launch(TINY, ["--step-delay", "0.05"], nproc_per_node=2, train={"steps": 10_000}, telemetry=FAST)
    deadline = time.monotonic() + 60
    while not all(of(records(tmp_path), "step", rank) for rank in (0, 1)):  # both ranks are streaming
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output
        time.sleep(0.2)
    job.proc.kill()  # SIGKILL: no teardown, the collector vanishes mid-stream
    job.wait()
    deadline = time.monotonic() + 15
    while job.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.leftovers() == [], job.output


def _mount_small_filesystem(directory: Path, size: str) -> bool:
    """A `size` tmpfs at `directory` (needs root, or CAP_SYS_ADMIN); False where it cannot be mounted."""
    import shutil
    import subprocess

    if shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                          capture_output=True).returncode == 0


@pytest.mark.slow
def test_a_full_disk_under_runs_leaves_the_workers_exit_code_and_one_warning(launch, tmp_path):
    import subprocess

    runs = tmp_path / "runs"
    runs.mkdir()
    if not _mount_small_filesystem(runs, "16k"):
        pytest.skip("cannot mount a size-limited file system here (needs root): the full-disk case is not tested")
    try:
        job = launch(TINY, nproc_per_node=2, train={"steps": 40}, telemetry=FAST)
        assert job.wait() == 0, job.output
        stderr = "\n".join(job.stderr)
        warnings = [line for line in job.stderr if line.startswith("zerorun: warning: telemetry: cannot write ")]
        assert len(warnings) == 1 and "No space left on device" in warnings[0], job.output
        assert "Traceback" not in stderr and "OSError" not in stderr
        assert "job " in stderr and "40/40 steps" in stderr  # the summary, from memory
        assert job.leftovers() == []
    finally:
        subprocess.run(["umount", "-l", str(runs)], capture_output=True)


@pytest.mark.slow
def test_a_runs_disk_full_before_the_launch_keeps_the_lock_warns_once_of_its_record_and_trains(launch, tmp_path):
    """Issue 57: the lock record's write raised OSError 28 through the launcher; the job must train as before."""
    import subprocess

    from tests.launch.test_ownership import full_tmpfs

    runs = tmp_path / "runs"
    if not full_tmpfs(runs):
        pytest.skip("cannot mount a size-limited file system here (needs root): tests/launch/test_ownership.py "
                    "injects the full disk instead")
    try:
        job = launch(TINY, nproc_per_node=2, train={"steps": 6}, telemetry=FAST)
        assert job.wait() == 0, job.output
        stderr = "\n".join(job.stderr)
        lock = [line for line in job.stderr if "locked for this job, but which job holds it could not" in line]
        assert len(lock) == 1 and "No space left on device" in lock[0], job.output
        assert "Traceback" not in stderr and "6/6 steps" in stderr
        assert job.leftovers() == []
    finally:
        subprocess.run(["umount", "-l", str(runs)], capture_output=True)


@pytest.mark.slow
def test_tensorboard_and_csv_from_the_launcher_hold_every_rank_s_loss_per_step_and_report_plots_it(launch, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    job = launch(TINY, nproc_per_node=2, train={"steps": 6},
                 telemetry={"interval_s": 0.1, "tensorboard": True, "csv": True})
    assert job.wait() == 0, job.output
    recs = records(tmp_path)
    job_id = recs[0]["job_id"]
    losses = {(s["rank"], s["step"]): s["loss"] for s in of(recs, "step")}
    events = EventAccumulator(str(tmp_path / "runs" / "recipe" / "tensorboard" / job_id))
    events.Reload()  # tensorboard's own reader
    for rank in (0, 1):
        scalars = events.Scalars(f"loss/rank{rank}")
        assert [e.step for e in scalars] == [1, 2, 3, 4, 5, 6]
        assert [e.value for e in scalars] == pytest.approx([losses[(rank, s)] for s in range(1, 7)], rel=1e-6)
        assert events.Scalars(f"memory/model_state_bytes/rank{rank}")[-1].value > 0
    means = events.Scalars("loss/mean")
    assert [e.step for e in means] == [1, 2, 3, 4, 5, 6]
    assert means[0].value == pytest.approx((losses[(0, 1)] + losses[(1, 1)]) / 2, rel=1e-6)

    import csv

    with open(tmp_path / "runs" / "recipe" / "csv" / job_id / "steps.csv") as f:
        rows = list(csv.DictReader(f))
    assert sorted((int(r["rank"]), int(r["step"])) for r in rows) == sorted(losses)
    assert all(float(r["loss"]) == pytest.approx(losses[(int(r["rank"]), int(r["step"]))]) for r in rows)
    assert any("TensorBoard" in line and "CSV" in line for line in job.stderr)

    result = CliRunner().invoke(app, ["report", str(tmp_path / "runs" / "recipe")])
    assert result.exit_code == 0, result.output
    plots = tmp_path / "runs" / "recipe" / "plots" / job_id
    assert f"plots: {plots}/ loss.png, memory.png, time.png" in result.output  # no offload: no offload.png
    from matplotlib.image import imread

    for name in ("loss", "memory", "time"):
        image = imread(plots / f"{name}.png")
        assert image.shape[:2] == (650, 900), name  # 9 x 6.5 in at 100 dpi: a real picture was drawn
        assert image[..., :3].std() > 0.05, name  # not a blank page


@pytest.mark.slow
def test_ctrl_c_after_a_commit_counts_the_checkpoint_on_disk(launch, tmp_path):
    """Issue 57: the Ctrl-C summary said "3 saved; step-9" with step-12 on disk and verifying. A commit was told
    to telemetry at the training thread's next step only, and the teardown (SIGTERM) came first."""
    ckpt = tmp_path / "ckpt"
    job = launch(TINY, ["--step-delay", "4"], nproc_per_node=2, train={"steps": 1000}, telemetry=FAST,
                 checkpoint={"dir": str(ckpt), "every_steps": 2}, launch={"kill_grace_s": 10.0})
    deadline = time.monotonic() + 120
    while not (ckpt / "step-4").is_dir():  # committed; the next step (and so the next poll) is 4 s away
        assert time.monotonic() < deadline and job.proc.poll() is None, job.output
        time.sleep(0.05)
    job.send(signal.SIGINT)
    assert job.wait() == 130, job.output
    latest = (ckpt / "latest").read_text().strip()
    saved = sorted(p.name for p in ckpt.glob("step-*"))
    line = next(line for line in reversed(job.stderr) if line.startswith("zerorun: checkpoints: "))
    assert line.startswith(f"zerorun: checkpoints: {len(saved)} saved; {latest} (async)"), (saved, line)
    assert job.leftovers() == []
