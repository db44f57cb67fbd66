"""Telling the OOM killer's SIGKILL from any other: the cgroup counters and the kernel log, read from fakes."""

from __future__ import annotations

from pathlib import Path

from zerorun.launch import oom


def test_the_oom_kill_counter_is_read_from_cgroup_v2_and_v1(tmp_path: Path):
    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    (tmp_path / "cg2").write_text("0::/job\n")
    assert oom.oom_kills(v2, str(tmp_path / "cg2")) == 2
    v1 = tmp_path / "v1"
    (v1 / "memory" / "job").mkdir(parents=True)
    (v1 / "memory" / "job" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    (tmp_path / "cg1").write_text("8:pids:/\n4:memory:/job\n0::/\n")
    assert oom.oom_kills(v1, str(tmp_path / "cg1")) == 5
    assert oom.oom_kills(tmp_path / "nothing", str(tmp_path / "cg1")) is None


def test_the_kernel_log_names_the_pid_only_after_it_started(tmp_path: Path, monkeypatch):
    log = tmp_path / "kmsg"  # a plain file reads whole, not one record per read: each line fits one read here
    line = "3,521,{us},-;Memory cgroup out of memory: Killed process {pid} (python3) total-vm:323768kB\n"
    log.write_text(line.format(us=5_000_000, pid=4321))
    monkeypatch.setattr(oom, "oom_kills", lambda: None)
    assert oom.killed_by_oom(4321, None, started=4.0, log=str(log))
    assert not oom.killed_by_oom(4321, None, started=60.0, log=str(log))  # an earlier process of that pid
    assert not oom.killed_by_oom(432, None, started=4.0, log=str(log))
    monkeypatch.setattr(oom, "oom_kills", lambda: 3)
    assert oom.killed_by_oom(1, 2, started=0.0, log=str(tmp_path / "unreadable"))  # the counter went up
