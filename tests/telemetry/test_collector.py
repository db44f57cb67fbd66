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


# --- hostile peers ----------------------------------------------------------------------------------

TOKEN = "s3cret"


def authed(address: str, token: str = TOKEN) -> socket.socket:
    from zerorun.telemetry.records import prove

    sock = connect(address)
    challenge = json.loads(sock.makefile("rb").readline())["challenge"]
    sock.sendall(json.dumps({"auth": prove(token, challenge)}).encode() + b"\n")
    return sock


def secured(tmp_path: Path) -> tuple[Collector, str]:
    collector = Collector(tmp_path / "telemetry.jsonl", token=TOKEN, job_id="job-1")
    address = collector.start()
    collector.record({"type": "job", "job_id": "job-1", "world_size": 2, "steps": 10, "t": 1.0})
    return collector, address


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_connection_that_does_not_prove_the_token_is_closed_and_read_nothing_from(tmp_path: Path):
    collector, address = secured(tmp_path)
    forged = b'{"type":"hello","rank":0,"t":2,"host":"x","pid":1,"pid_start":null}\n'
    for token in (None, "wrong"):  # no answer (a forged hello straight away), a wrong one
        sock = connect(address) if token is None else authed(address, token)
        sock.sendall(forged)
        assert closed_by_peer(sock)
    sock = authed(address)
    sock.sendall(b'{"type":"hello","rank":1,"t":2,"host":"n1","pid":7,"pid_start":1.5}\n')
    wait_for_records(collector, 2)
    collector.close()
    assert list(collector.state.ranks) == [1] and collector.refused == 2
    assert json.loads((tmp_path / "telemetry.jsonl").read_text().splitlines()[-1])["job_id"] == "job-1"


def test_a_bad_record_is_dropped_and_counted_and_the_collector_serves_on(tmp_path: Path):
    collector, address = secured(tmp_path)
    sock = authed(address)
    bad = [b'{"type":"sample","rank":0,"t":2,"cuda":5}',
           b'{"type":"step","rank":0,"t":2,"step":"many"}', b'{"type":"step","rank":-1,"t":2,"step":3}',
           b'{"type":"step","rank":2,"t":2,"step":3}', b'{"type":"end","exit_code":0,"t":2}',
           b'{"type":"stall","t":2}', b'{"type":"sample","rank":0,"t":2,"where":{"file":"' + b"x" * 5000 + b'"}}',
           b'{"type":"step","rank":1,"t":2,"step":1,"step_time_s":0.1}']  # another rank on rank 0's connection
    sock.sendall(b'{"type":"step","rank":0,"t":2,"step":1,"step_time_s":0.1}\n' + b"\n".join(bad) + b"\n")
    sock.sendall(b'{"type":"sample","rank":0,"t":3,"rss":5,"cuda":{"allocated":1,"peak":2}}\n')
    wait_for_records(collector, 3)
    collector.close()
    assert collector.rejected == len(bad) and collector.rejected_reason == "sample: cuda: expected a mapping, got int"
    assert collector.state.ranks[0].device_peak == 2 and list(collector.state.ranks) == [0]
    assert collector.state.exit_code is None and collector.state.stalls == []


def test_unauthenticated_connections_are_bounded_in_bytes_count_and_time(tmp_path: Path, monkeypatch):
    from zerorun.telemetry import collector as module

    monkeypatch.setattr(module, "PROVE_S", 0.5)
    collector, address = secured(tmp_path)
    hogs = [connect(address) for _ in range(module.MAX_UNPROVEN + 5)]
    for sock in hogs[:10]:
        try:
            sock.sendall(b"x" * 100_000)  # no newline
        except OSError:
            pass
    assert all(closed_by_peer(sock) for sock in hogs)  # over the byte limit, over the count, or too slow
    assert collector.refused == len(hogs)
    good = authed(address)  # and a worker still gets in
    good.sendall(b'{"type":"bye","rank":0,"t":2}\n')
    wait_for_records(collector, 2)
    collector.close()


def test_stall_history_is_capped():
    from zerorun.telemetry.state import MAX_STALLS, RunState

    state = RunState()
    for i in range(3 * MAX_STALLS):
        state.ingest({"type": "stall", "t": i, "quiet_s": i}, float(i))
    assert len(state.stalls) == MAX_STALLS and state.stalls[-1]["quiet_s"] == 3 * MAX_STALLS - 1


def test_the_report_keeps_jobs_apart_even_when_their_records_interleave(tmp_path: Path):
    from zerorun.telemetry.report import load_records

    lines = [{"type": "job", "job_id": "a", "t": 1}, {"type": "step", "rank": 0, "step": 1, "job_id": "a", "t": 2},
             {"type": "job", "job_id": "b", "t": 3}, {"type": "step", "rank": 0, "step": 9, "job_id": "a", "t": 4},
             {"type": "step", "rank": 0, "step": 1, "job_id": "b", "t": 5},
             {"type": "step", "rank": 0, "step": 2, "job_id": "a-r1", "t": 6}]
    (tmp_path / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert [r.get("step") for r in load_records(tmp_path)] == [None, 1]
    assert [r.get("step") for r in load_records(tmp_path, "a")] == [None, 1, 9, 2]
