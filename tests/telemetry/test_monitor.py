"""The launcher's monitor as the supervisor's output, without workers: live and plain display, stalls."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest

from tests.telemetry.test_console import job_records
from zerorun import config
from zerorun.launch.hostfile import Node
from zerorun.launch.monitor import Monitor
from zerorun.launch.plan import MachineFacts, plan


def make_monitor(tmp_path: Path, live: bool, **telemetry: float) -> tuple[Monitor, io.BytesIO, io.BytesIO]:
    recipe = config.from_dict({"script": "/x/train.py", "train": {"steps": 10}, "telemetry": telemetry}, "<test>")
    recipe.name, recipe.given["train.steps"] = "demo", "<test>"  # the user gave the total (config.known_steps)
    launch_plan = plan(recipe, [Node("localhost", (0, 1))], "demo-1", 29500, MachineFacts(2, "python"))
    out, err = io.BytesIO(), io.BytesIO()
    return Monitor(launch_plan, out, err, live=live, runs_dir=tmp_path / "runs", width=160), out, err


def feed(monitor: Monitor, records: list[dict]) -> None:
    for record in records:
        if record["type"] not in ("job", "end"):
            monitor.collector.record(record)


def test_live_mode_prints_worker_lines_above_the_table_and_the_summary_at_the_end(tmp_path: Path):
    monitor, out, err = make_monitor(tmp_path, live=True)
    monitor.start()
    monitor.write(1, b"[localhost:0] hello from rank 0")
    monitor.write(2, b"[localhost:1] a warning on stderr")
    feed(monitor, job_records()[1:-4])
    monitor.tick()
    shown = out.getvalue().decode()
    assert shown.index("hello from rank 0") < shown.index("a warning on stderr") < shown.index("step 4/10")
    assert "gpu-node" in shown and err.getvalue() == b""  # on a terminal everything shares the live console
    monitor.finish(0)
    shown = out.getvalue().decode()
    assert "job demo-1: 4/10 steps" in shown and "peak RSS" in shown
    assert "zerorun report " + str(tmp_path / "runs" / "demo") in err.getvalue().decode()


def test_plain_mode_passes_lines_through_and_prints_a_summary_line_per_tenth_of_the_steps(tmp_path: Path):
    monitor, out, err = make_monitor(tmp_path, live=False)
    monitor.start()
    monitor.write(1, b"[localhost:0] hello")
    records = job_records(steps=10)[1:-4]
    for step in range(1, 11):
        feed(monitor, [r for r in records if r.get("step", 1) == step and r["type"] == "step"])
        monitor.tick()
        monitor.tick()  # nothing new: no second line
    monitor.finish(0)
    assert out.getvalue() == b"[localhost:0] hello\n"
    lines = err.getvalue().decode().splitlines()
    summaries = [line for line in lines if line.startswith("zerorun: step ")]
    assert [line.split()[2] for line in summaries] == [f"{s}/10" for s in range(1, 11)]
    assert any("job demo-1: 10/10 steps" in line for line in lines)
    written = (tmp_path / "runs" / "demo" / "telemetry.jsonl").read_text().splitlines()
    assert '"type":"job"' in written[0] and '"type":"end"' in written[-1]


def test_a_stall_is_reported_once_per_stall_s_and_never_signals_a_pid_that_is_not_the_worker(tmp_path: Path):
    monitor, _, err = make_monitor(tmp_path, live=False, stall_s=0.2)
    monitor.start()
    records = [r for r in job_records()[1:-4] if r["type"] != "hello"]
    # rank 0 "is" this test process but started at another time (a reused pid): it must not be signalled
    feed(monitor, [{"type": "hello", "rank": 0, "t": 1.0, "host": "localhost", "pid": os.getpid(), "pid_start": 1.0},
                   {"type": "hello", "rank": 1, "t": 1.0, "host": "far-away", "pid": 1234, "pid_start": 1.0}])
    feed(monitor, records)
    monitor.tick()
    assert "stall" not in err.getvalue().decode()
    time.sleep(0.25)
    monitor.tick()
    monitor.tick()
    monitor.finish(1)
    shown = err.getvalue().decode()
    assert shown.count("zerorun: stall: no rank has finished a step for") == 1
    assert "zerorun: all ranks: rank 0 on localhost at step 4, in main (train.py:7)" in shown
    assert f"rank 0 on localhost: no stack: pid {os.getpid()} is a different process now" in shown
    assert "rank 1 on far-away: no stack: on another machine" in shown


def test_the_stall_watch_signals_only_a_process_that_carries_the_jobs_id():
    import os

    import psutil

    from zerorun.launch.monitor import verified_pid

    me = psutil.Process()
    assert verified_pid(os.getpid(), me.create_time(), "job-1") == f"pid {os.getpid()} is not a process of job job-1"
    assert verified_pid(os.getpid(), me.create_time() - 100, "job-1").endswith("is a different process now")
    from zerorun.launch.monitor import _signal_stack
    from zerorun.telemetry.state import RankState

    unverified = RankState(0, host="localhost", pid=os.getpid(), pid_start=None)
    assert _signal_stack(unverified, "job-1") == "it never said hello"


@pytest.mark.parametrize("matplotlib", [True, False])
def test_the_last_line_promises_plots_only_where_matplotlib_can_draw_them(tmp_path: Path, matplotlib: bool,
                                                                         monkeypatch: pytest.MonkeyPatch):
    """Issue 57: every launch promised "with plots", matplotlib installed or not."""
    import sys

    if not matplotlib:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where the `report` extra is not installed
    monitor, out, err = make_monitor(tmp_path, live=False)
    monitor.start()
    feed(monitor, job_records()[1:-4])
    monitor.finish(0)
    (last,) = [line for line in err.getvalue().decode().splitlines() if "shows this summary again" in line]
    if matplotlib:
        assert last.endswith("shows this summary again, with plots")
    else:
        assert last.endswith("shows this summary again (plots need matplotlib: pip install 'zerorun[report]')")
