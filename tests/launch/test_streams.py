"""The worker's output relay and the launcher's parser, without torch or torchrun (fast)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.launch.launched import subprocess_env
from zerorun.launch import streams
from zerorun.launch.streams import RankExit, RankLine


def relay(body: str, exit_record: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run `body` as the worker side of `relay_from_child('h', 3, ...)` in a fresh interpreter."""
    code = "from zerorun.launch import streams\n" \
           f"streams.relay_from_child('h', 3, exit_record={exit_record})\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, env=subprocess_env(), timeout=30)


def records(stderr: bytes) -> list[RankExit]:
    return [item for item in map(streams.parse, stderr.splitlines()) if isinstance(item, RankExit)]


def test_relay_prefixes_python_and_fd_level_output_and_ends_unterminated_lines():
    result = relay("""
        import os, sys
        print("from python")
        os.write(1, b"from fd 1\\nno newline at the end")
        print("to stderr", file=sys.stderr)
    """)
    assert result.returncode == 0
    assert result.stdout.splitlines() == [b"[h:3] from python", b"[h:3] from fd 1", b"[h:3] no newline at the end"]
    assert result.stderr.splitlines()[0] == b"[h:3] to stderr"
    assert records(result.stderr) == [RankExit("h", 3, 0, None)]


def test_relay_keeps_the_last_lines_of_a_worker_that_dies_abruptly_and_mirrors_its_status():
    result = relay("""
        import os
        os.write(2, b"last words\\n")
        os._exit(7)
    """)
    assert result.returncode == 7
    assert b"[h:3] last words" in result.stderr.splitlines()
    assert records(result.stderr) == [RankExit("h", 3, 7, None)]


def test_relay_reports_a_signal_death_as_128_plus_the_signal():
    result = relay("""
        import os, signal
        print("before", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert result.returncode == 128 + 9
    assert result.stdout == b"[h:3] before\n"
    (record,) = records(result.stderr)
    assert record.signal == 9 and record.failed and record.exit_status == 137
    assert record.describe() == "killed by SIGKILL"


def test_relay_without_exit_record_writes_only_prefixed_lines():
    result = relay("raise SystemExit(0)", exit_record=False)
    assert result.returncode == 0 and result.stderr == b""


def test_parse_tells_rank_lines_exit_records_and_torchrun_lines_apart():
    assert streams.parse(b"[node-1:12] hello") == RankLine("node-1", 12, b"[node-1:12] hello")
    assert streams.parse(b'\x1ezerorun-exit {"host": "a", "rank": 2, "code": 3, "signal": null}') == \
        RankExit("a", 2, 3, None)
    assert streams.parse(b"WARNING:torch.distributed.run: something") is None
    assert streams.parse(b"\x1ezerorun-exit not json") is None


def test_torchruns_teardown_line_starts_its_report():
    """Issue 57: after `kill -9` of a worker, torchrun's "Sending process N closing signal SIGTERM" came before its
    line naming the failed rank, and so was printed raw instead of going to the failure log with its report."""
    line = (b"W1128 20:06:28.202000 13159 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] "
            b"Sending process 13182 closing signal SIGTERM")
    assert streams.torchrun_tearing_down(line) and streams.parse(line) is None  # torchrun's own, now held
    assert not streams.torchrun_tearing_down(b"I1128 starting the agent")


def test_the_failure_banner_fits_the_summarys_width():
    """Issue 57: the banner over a culprit's output was 142 columns wide (a long cause between two 20-column rules)."""
    import io

    from zerorun import tables
    from zerorun.launch.failure_report import FailureReport
    from zerorun.launch.held_output import HeldOutput
    from zerorun.launch.outcome import Output

    err = io.BytesIO()
    report = FailureReport("j", Output(io.BytesIO(), err), HeldOutput(), {}, None)
    cause = "rank 1 on localhost failed (killed by SIGKILL; its output relay died with it, torchrun saw the exit)"
    report._failure_block(cause, [b"[localhost:1] last words"], "last 1 lines of rank 1")
    lines = err.getvalue().decode().splitlines()
    assert max(map(len, lines)) <= tables.WIDTH, lines
    assert " ".join(" ".join(lines).replace("=", " ").split()).startswith(cause), lines
    assert set(lines[-1]) == {"="} and len(lines[-1]) == len(lines[0])


@pytest.mark.parametrize(("given", "last", "hinted"), [
    (True, b"ValueError: Unknown config key: local_rank", True),  # nanoGPT's configurator
    (True, b"t.py: error: unrecognized arguments: --local_rank=1", True),  # argparse
    (False, b"t.py: error: unrecognized arguments: --local_rank=1", False),  # the user's own --local_rank
    (True, b"KeyError: 'WORLD_SIZE'", False),  # the source line above names local_rank: not the error
])
def test_a_failure_on_the_given_local_rank_says_how_to_launch_without_it(given: bool, last: bytes, hinted: bool):
    import collections
    import io

    from zerorun.launch.failure_report import LOCAL_RANK_HINT, FailureReport
    from zerorun.launch.held_output import HeldOutput
    from zerorun.launch.outcome import Ending, Outcome, Output

    err = io.BytesIO()
    source = b"[localhost:1]     local_rank = int(os.environ['LOCAL_RANK'])"
    tail = collections.deque([source, b"[localhost:1] " + last])
    report = FailureReport("j", Output(io.BytesIO(), err), HeldOutput(), {("localhost", 1): tail}, None, given)
    report.report(Outcome(1, Ending.RANK_FAILED, "rank 1 on localhost failed (exit code 1)", "localhost", 1), [])
    assert (f"zerorun: {LOCAL_RANK_HINT}" in err.getvalue().decode().splitlines()) is hinted
