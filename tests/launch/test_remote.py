"""The remote supervisor on its own (no ssh): it ends the node's processes when the launcher is gone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.launch.launched import subprocess_env
from zerorun.launch.transport import processes_with_job_id

IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(60)")


def _start_remote(job_id: str, heartbeat_timeout_s: float) -> subprocess.Popen[bytes]:
    env = {**subprocess_env(), "ZERORUN_JOB_ID": job_id, "ZERORUN_NODE_HOST": "node-b"}
    proc = subprocess.Popen([sys.executable, "-m", "zerorun.launch.remote", "--heartbeat-timeout",
                             str(heartbeat_timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    header = {"argv": [sys.executable, "-c", IGNORES_SIGTERM], "env": {}, "cwd": os.getcwd(), "kill_grace_s": 0.5}
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps(header).encode() + b"\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == b"up\n"
    return proc


def test_silent_launcher_half_open_connection_ends_the_node_after_the_heartbeat_timeout():
    job_id = f"remote-test-{os.getpid()}-hb"
    proc = _start_remote(job_id, heartbeat_timeout_s=1.0)  # stdin stays open but nothing arrives
    started = time.monotonic()
    assert proc.wait(timeout=15) == 137  # its command ignored SIGTERM: SIGKILL after the grace period
    assert time.monotonic() - started < 5
    assert b"no heartbeat from the launcher for 1 s" in proc.stderr.read()
    assert processes_with_job_id(job_id) == []


def test_stdin_closing_ends_the_node_at_once():
    job_id = f"remote-test-{os.getpid()}-eof"
    proc = _start_remote(job_id, heartbeat_timeout_s=60.0)
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=10) == 137
    assert b"the launcher closed the connection" in proc.stderr.read()
    assert processes_with_job_id(job_id) == []
