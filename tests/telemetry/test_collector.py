"""The collector on its own: raw TCP clients, the JSONL file and the folded state."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from zerorun.telemetry.collector import Collector


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def wait_for_records(collector: Collector, count: int) -> None:
    deadline = time.monotonic() + 10
    while collector.records < count:
        assert time.monotonic() < deadline, f"only {collector.records} of {count} records arrived"
        time.sleep(0.01)


def test_records_from_several_connections_are_appended_and_folded_and_junk_is_dropped(tmp_path: Path):
    path = tmp_path / "runs" / "job" / "telemetry.jsonl"
    collector = Collector(path)
    address = collector.start()
    collector.record({"type": "job", "job_id": "j1", "world_size": 2, "steps": 10, "t": 1.0})
    a, b = connect(address), connect(address)
    a.sendall(b'{"type":"hello","rank":0,"t":2,"host":"n0","pid":11}\n{"type":"step","rank":0,"t":3,"step":1,'
              b'"loss":2.5,"step_time_s":0.1}\nnot json\n[1, 2]\n{"no_type": 1}\n')
    b.sendall(b'{"type":"step","rank":1,"t":3,"step":1,"loss":2.7,"step_time_s":0.1}\n{"type":"step","ra')  # cut short
    wait_for_records(collector, 4)
    b.close()  # the unfinished line goes with the connection
    a.sendall(b'{"type":"step","rank":0,"t":4,"step":2,"loss":2.0,"step_time_s":0.1}\n')
    wait_for_records(collector, 5)
    a.close()
    collector.close()

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["type"], r.get("rank"), r.get("step")) for r in lines] == [
        ("job", None, None), ("hello", 0, None), ("step", 0, 1), ("step", 1, 1), ("step", 0, 2)]
    state = collector.state
    assert state.job["job_id"] == "j1" and state.ranks[0].host == "n0" and state.ranks[0].pid == 11
    assert (state.ranks[0].step, state.ranks[0].loss, state.ranks[1].step) == (2, 2.0, 1)
    assert state.step == 1  # the step every rank has finished


def test_a_second_job_of_the_same_name_appends_to_the_same_file(tmp_path: Path):
    path = tmp_path / "telemetry.jsonl"
    for job_id in ("first", "second"):
        collector = Collector(path)
        collector.start()
        collector.record({"type": "job", "job_id": job_id, "t": 1.0})
        collector.close()
    assert [json.loads(line)["job_id"] for line in path.read_text().splitlines()] == ["first", "second"]
