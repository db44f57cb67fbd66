"""A rank killed by SIGKILL is the culprit, also on a loaded machine and also when the process killed is
the rank's output relay (the process torchrun started), whose death leaves no exit record.

The kernel's OOM killer picks the largest process; a user's `kill -9` may pick the pid torchrun
names. In both cases torchrun SIGTERMs the other workers a moment later: their exit records
("killed by SIGTERM") must not make them the culprit. The machine is loaded with a few bounded
busy-loop processes (they end by themselves and are killed at the end of the test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

TINY = str(Path(__file__).resolve().parents[1] / "telemetry" / "scripts" / "tiny_train.py")
BUSY_S = 60.0  # each busy loop ends by itself after this long


@pytest.fixture
def cpu_load() -> Iterator[None]:
    """One busy-loop process per core (at most 4), each ending by itself after BUSY_S."""
    count = min(4, os.cpu_count() or 1)
    loop = f"import time\nend = time.monotonic() + {BUSY_S}\nwhile time.monotonic() < end: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", loop]) for _ in range(count)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("target", ["relay", "rank"])
def test_a_sigkilled_rank_is_named_under_cpu_load(launch, cpu_load, target: str) -> None:
    job = launch(TINY, ["--step-delay", "0.05"], nproc_per_node=2, train={"steps": 100_000},
                 telemetry={"interval_s": 0.2})
    job.wait_until(lambda: sum("pid " in line for line in job.stdout) == 2, "both ranks training", timeout=120)
    time.sleep(2.0)  # a few steps
    worker = psutil.Process(next(int(line.split()[-1]) for line in job.stdout if line.startswith("[localhost:1] pid ")))
    relay = job.relay(1)
    if target == "relay":  # the process torchrun started: the worker's relay
        relay.kill()
    else:  # the whole rank at once: relay and worker (their process groups), as an OOM kill of the group would
        for group in {os.getpgid(relay.pid), os.getpgid(worker.pid)}:
            os.killpg(group, signal.SIGKILL)
    assert job.wait(timeout=120) == 137, job.output
    final = next(line for line in reversed(job.stderr) if line.startswith(f"zerorun: job {job.job_id} stopped: "))
    assert "rank 1 on localhost" in final and "SIGKILL" in final, job.output
    assert "rank 0 on localhost failed" not in final, job.output
    # issue 57: torchrun's raw teardown line and a 142-column banner were left in what the user reads
    assert not [line for line in job.stderr if line.startswith("[localhost:torchrun] ")], job.output
    banners = [line for line in job.stderr if line.startswith("=")]
    assert banners and max(map(len, banners)) <= 120, job.output
    deadline = time.monotonic() + 15
    while job.leftovers() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert job.leftovers() == []
