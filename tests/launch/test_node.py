"""The node supervisor on its own (no launcher, no ssh): orders on stdin, heartbeats, teardown, cleanup."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.launch.launched import subprocess_env
from zerorun.launch import streams
from zerorun.launch.node import NodeJob
from zerorun.launch.processes import processes_with_job_id

IGNORES_SIGTERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                   "print('up', flush=True); time.sleep(60)")


def _start_node(job_id: str, heartbeat_timeout_s: float, grace_s: float = 0.5,
                offload_dirs: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    env = {**subprocess_env(), "ZERORUN_JOB_ID": job_id, "ZERORUN_NODE_HOST": "node-b"}
    proc = subprocess.Popen([sys.executable, "-m", "zerorun.launch.node", "--heartbeat-timeout",
                             str(heartbeat_timeout_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    job = NodeJob((sys.executable, "-c", IGNORES_SIGTERM), {}, os.getcwd(), grace_s, offload_dirs=offload_dirs)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(job.header())
    proc.stdin.flush()
    assert proc.stdout.readline() == b"up\n"
    return proc


def _notes(stderr: bytes) -> list[str]:
    return [item.text for item in map(streams.parse, stderr.splitlines()) if isinstance(item, streams.NodeNote)]


def test_silent_launcher_half_open_connection_ends_the_node_after_the_heartbeat_timeout():
    job_id = f"node-test-{os.getpid()}-hb"
    proc = _start_node(job_id, heartbeat_timeout_s=1.0)  # stdin stays open but nothing arrives
    started = time.monotonic()
    assert proc.wait(timeout=15) == 137  # its command ignored SIGTERM: SIGKILL after the grace period
    assert time.monotonic() - started < 5
    stderr = proc.stderr.read()
    assert "no heartbeat from the launcher for 1 s; stopping job" in " ".join(_notes(stderr))
    assert streams.BEAT_RECORD + b"\n" in stderr  # the node's own heartbeat, every second
    assert processes_with_job_id(job_id) == []


def test_stdin_closing_ends_the_node_at_once():
    job_id = f"node-test-{os.getpid()}-eof"
    proc = _start_node(job_id, heartbeat_timeout_s=60.0)
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=10) == 137
    assert "the launcher closed the connection" in " ".join(_notes(proc.stderr.read()))
    assert processes_with_job_id(job_id) == []


def test_a_kill_order_during_the_grace_period_kills_at_once(tmp_path: Path):
    job_id = f"node-test-{os.getpid()}-kill"
    proc = _start_node(job_id, heartbeat_timeout_s=60.0, grace_s=60.0)
    assert proc.stdin is not None
    proc.stdin.write(b"stop\n")  # orderly: SIGTERM, which the command ignores, then a 60 s grace period
    proc.stdin.flush()
    time.sleep(1.0)
    assert proc.poll() is None
    proc.stdin.write(b"kill\n")
    proc.stdin.flush()
    started = time.monotonic()
    assert proc.wait(timeout=15) == 137
    assert time.monotonic() - started < 10
    assert _notes(proc.stderr.read()) == []  # the launcher's own orders need no narration
    assert processes_with_job_id(job_id) == []


def test_the_node_removes_its_offload_files_however_the_job_ends(tmp_path: Path):
    rank_dir = tmp_path / "nvme" / "run" / "rank-0"
    (rank_dir / "params").mkdir(parents=True)
    for name in ("master.bin", "exp_avg.bin", "params/0.bin"):
        (rank_dir / name).write_bytes(b"\0" * 8192)
    (tmp_path / "nvme" / "keep.txt").write_text("not ours")
    proc = _start_node(f"node-test-{os.getpid()}-nvme", heartbeat_timeout_s=60.0, offload_dirs=(str(rank_dir),))
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=10) == 137
    notes = _notes(proc.stderr.read())
    assert any("removed 3 NVMe offload file(s) of this job on node-b" in note for note in notes), notes
    assert not (tmp_path / "nvme" / "run").exists() and (tmp_path / "nvme" / "keep.txt").exists()


def test_the_node_removes_the_shared_memory_segments_its_job_left_and_no_others(tmp_path):
    from zerorun.launch import shm_prefix
    from zerorun.launch.node import remove_shm_segments

    mine = [f"{shm_prefix('job-1')}{pid}-abc" for pid in (11, 12)]  # a rank killed while the ranks mapped it
    others = [f"{shm_prefix('job-2')}13-abc", "zerorun-14-abc", "other"]
    for name in mine + others:
        (tmp_path / name).write_bytes(b"x")
    assert sorted(remove_shm_segments("job-1", str(tmp_path))) == sorted(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(others)
