"""Real launches with a fault injected: the right culprit named, a fast teardown, nothing left behind.

Each test starts `python -m zerorun.cli launch` on a fresh recipe (tests/launch/launched.py),
injects one fault, and checks what the launcher said, how long it took, and that no process of
the job (by job id and by the pids the workers printed) and no NVMe offload file is left.
Time limits are generous against the slowest loaded machine seen, yet far below what each fault
took before its fix (in parentheses): the limits are about the design, not this machine's speed.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

TINY = str(Path(__file__).resolve().parents[1] / "telemetry" / "scripts" / "tiny_train.py")
TEARDOWN_LIMIT_S = 15.0


def _no_leftovers_within(job, seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    while (left := job.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _stopped_line(job) -> str:
    return next(line for line in reversed(job.stderr) if line.startswith(f"zerorun: job {job.job_id} stopped: "))


@pytest.mark.slow
def test_a_hanging_rank_is_named_in_the_final_report_not_the_rank_that_timed_out_waiting(launch):
    job = launch(TINY, ["--sleep-rank", "1", "--sleep-at", "2", "--sleep-s", "120"], nproc_per_node=2,
                 train={"steps": 50}, launch={"timeout_s": 5.0, "kill_grace_s": 1.0}, telemetry={"interval_s": 0.2})
    assert job.wait(timeout=120) == 1, job.output  # rank 0's collective timed out
    final = _stopped_line(job)
    assert "rank 1 on localhost stopped making progress at step 2, in sleep_here (tiny_train.py:" in final, job.output
    assert "rank 0 on localhost failed waiting for it (exit code 1)" in final
    stderr = "\n".join(job.stderr)
    assert "zerorun: evidence: rank 1 on localhost: step 2, in sleep_here" in stderr
    assert "zerorun: evidence: rank 0 on localhost: step 2, in " in stderr and "waiting in a collective" in stderr
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_second_sigint_during_the_grace_period_ends_the_launcher_at_once(launch):
    job = launch("stubborn.py", launch={"kill_grace_s": 60.0})  # workers ignore SIGTERM: 60 s of grace
    job.wait_for("ready", count=2)
    job.send(signal.SIGINT)
    job.wait_until(lambda: any("received SIGINT; stopping job" in line for line in job.stderr), "the first stop")
    time.sleep(1.0)
    job.send(signal.SIGINT)
    assert job.wait(timeout=60) == 130, job.output
    assert job.seconds_since("signal") < TEARDOWN_LIMIT_S
    assert any("received SIGINT again; killing job" in line for line in job.stderr)
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_launcher_killed_in_its_grace_period_leaves_no_worker_that_ignores_sigterm(launch):
    job = launch("stubborn.py", launch={"kill_grace_s": 3.0})
    job.wait_for("ready", count=2)
    pids = job.worker_pids()
    job.send(signal.SIGINT)  # the launcher asks every node to stop: SIGTERM, which the workers ignore...
    job.wait_until(lambda: any("received SIGINT; stopping job" in line for line in job.stderr), "the first stop")
    job.proc.kill()  # ...and dies before its grace period is over
    job.wait()
    assert _no_leftovers_within(job, 3.0 + TEARDOWN_LIMIT_S) == [], pids


@pytest.mark.slow
def test_nvme_offload_files_are_removed_after_ctrl_c_and_after_a_killed_rank(launch, direct_io_dir: Path):
    keys = {"nproc_per_node": 2, "train": {"steps": 100_000}, "telemetry": {"interval_s": 0.2},
            "zero": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(direct_io_dir)}}}
    files = lambda: sorted(p.name for p in direct_io_dir.rglob("*.bin"))  # noqa: E731
    for fault in ("ctrl-c", "kill-rank"):
        job = launch(TINY, ["--step-delay", "0.05"], **keys)
        job.wait_until(lambda: sum("pid " in line for line in job.stdout) == 2, "both ranks training")
        job.wait_until(lambda: len(files()) == 6, "the offload files of both ranks")
        if fault == "ctrl-c":
            job.send(signal.SIGINT)
            assert job.wait() == 130, job.output
        else:
            rank1 = next(int(line.split()[-1]) for line in job.stdout if line.startswith("[localhost:1] pid "))
            psutil.Process(rank1).kill()
            assert job.wait() == 137, job.output
        assert files() == [], f"{fault}: {files()} left\n{job.output}"
        assert any("NVMe offload file(s) of this job on localhost" in line for line in job.stderr), job.output
        assert job.leftovers() == []


def test_a_bad_nvme_path_fails_in_preflight_before_any_worker_starts(launch, tmp_path: Path):
    missing = tmp_path / "no-such-dir"
    job = launch(TINY, nproc_per_node=2,
                 zero={"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(missing)}})
    assert job.wait(timeout=60) == 2, job.output  # a user error, as the CLI reports it
    stderr = "\n".join(job.stderr)
    assert f"preflight failed on localhost; nothing was started: zero.offload_optimizer.nvme_path: {missing} " \
           "does not exist" in stderr, job.output
    assert job.stdout == [] and job.job_id is None


@pytest.mark.slow
def test_a_zerorun_error_in_every_rank_prints_its_message_once_and_no_traceback(launch, tmp_path: Path):
    (tmp_path / "fails.py").write_text(
        "import torch.distributed as dist\n"
        "from zerorun.errors import ZerorunError\n"
        "dist.barrier()\n"
        "raise ZerorunError('the data file is missing; pass --data PATH')\n")
    job = launch(str(tmp_path / "fails.py"), nproc_per_node=2)
    assert job.wait(timeout=60) == 2, job.output
    errors = [line for line in job.stderr if "zerorun: error: the data file is missing" in line]
    assert len(errors) == 1, job.output
    assert not any("Traceback" in line for line in job.stderr)
    assert "failed (exit code 2)" in _stopped_line(job)
    assert job.leftovers() == []


@pytest.mark.slow
@pytest.mark.parametrize("training", [False, True], ids=["idle", "training"])
def test_a_half_open_ssh_link_is_torn_down_within_15_s_and_reported_as_lost_contact(launch_ssh, training):
    if training:
        job = launch_ssh(TINY, ["--step-delay", "0.05"], nproc=1, train={"steps": 100_000})
        job.wait_until(lambda: sum("pid " in line for line in job.stdout) == 2, "both ranks training")
    else:
        job = launch_ssh("stubborn.py", nproc=1)
        job.wait_for("ready", count=2)
    client = next(p for p in psutil.Process(job.proc.pid).children() if p.name() == "ssh" and "127.0.0.2" in p.cmdline())
    client.send_signal(signal.SIGSTOP)  # the link stays "open" and carries nothing
    stopped = time.monotonic()
    try:
        assert job.wait(timeout=TEARDOWN_LIMIT_S + 30) != 0, job.output
        assert time.monotonic() - stopped < TEARDOWN_LIMIT_S, job.output
        final = _stopped_line(job)
        assert "lost contact with 127.0.0.2: no heartbeat for " in final, job.output
        assert "rank 0" not in final
        assert _no_leftovers_within(job, TEARDOWN_LIMIT_S) == []
    finally:
        try:
            client.send_signal(signal.SIGCONT)
        except psutil.NoSuchProcess:
            pass


def test_the_root_failure_is_the_first_rank_that_was_not_waiting_for_the_others():
    from zerorun import config
    from zerorun.launch.hostfile import Node
    from zerorun.launch.plan import MachineFacts, plan
    from zerorun.launch.streams import RankExit
    from zerorun.launch.supervisor import Ending, Supervisor
    from zerorun.launch.transport import Transport
    from zerorun.telemetry.state import Culprit

    class Idle(Transport):
        def start(self, node):  # noqa: ANN001, ANN202 - never started here
            raise AssertionError

        def poll(self) -> int | None:
            return None

        def stop(self, grace_s: float) -> int:
            return 0

    class Witness:  # rank 0 was waiting in a collective (a victim); rank 1 was not
        def waiting(self, rank: int) -> bool:
            return rank == 0

        def culprit(self, failed_rank: int) -> None:
            return None

    recipe = config.from_dict({"script": "/x/t.py"})
    launch_plan = plan(recipe, [Node("a", (0,)), Node("b", (0,))], "j", 1, MachineFacts(2, "py"))
    supervisor = Supervisor(launch_plan, [Idle("a", "j"), Idle("b", "j")], witness=Witness())
    supervisor._failures = [RankExit("a", 0, 1, None), RankExit("b", 1, None, 9)]  # the victim's record came first
    outcome = supervisor._outcome_of_failure()
    assert (outcome.ending, outcome.rank, outcome.host, outcome.exit_code) == (Ending.RANK_FAILED, 1, "b", 137)
    assert outcome.cause == "rank 1 on b failed (killed by SIGKILL)"
    supervisor._failures = [RankExit("b", 1, None, 15), RankExit("a", 0, 1, None)]  # torchrun's SIGTERM came first
    assert supervisor._outcome_of_failure().rank == 0  # the rank that failed by itself, even while waiting

    class Blaming(Witness):  # the telemetry says every failed rank waited for rank 0
        def culprit(self, failed_rank: int) -> Culprit:
            return Culprit(0, "a", "stopped making progress at step 4, in write_atomic", ("evidence",))

    supervisor.witness = Blaming()
    supervisor._failures = [RankExit("b", 1, None, 9)]
    outcome = supervisor._outcome_of_failure()  # a SIGKILL is a cause, whatever its last sample said
    assert (outcome.rank, outcome.cause) == (1, "rank 1 on b failed (killed by SIGKILL)")
    supervisor._failures = [RankExit("b", 1, 1, None)]  # an exception while waiting: its peer is named
    outcome = supervisor._outcome_of_failure()
    assert outcome.rank == 0 and outcome.cause.endswith("rank 1 on b failed waiting for it (exit code 1)")


def test_a_rank_whose_relay_was_killed_is_named_from_torchruns_line_not_the_peer_torchrun_sigtermed():
    from zerorun import config
    from zerorun.launch import streams
    from zerorun.launch.hostfile import Node
    from zerorun.launch.plan import MachineFacts, plan
    from zerorun.launch.streams import RankExit
    from zerorun.launch.supervisor import Supervisor

    line = b"E1126 12:56:39.840000 6636 api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 6660) of binary: py"
    assert streams.torchrun_exit(line, "a", 2) == RankExit("a", 3, None, 9, by_torchrun=True)
    assert streams.torchrun_exit(b"Sending process 6659 closing signal SIGTERM", "a", 0) is None
    recipe = config.from_dict({"script": "/x/t.py"})
    launch_plan = plan(recipe, [Node("a", (0, 1))], "j", 1, MachineFacts(2, "py"))
    supervisor = Supervisor(launch_plan, [_Exited("a", "j")])
    supervisor._failures = [RankExit("a", 0, None, 15)]  # torchrun's SIGTERM to the survivor: its own record
    supervisor._handle(0, 2, line)  # the killed rank's only trace
    outcome = supervisor._outcome_of_failure()
    assert (outcome.rank, outcome.exit_code) == (1, 137)
    assert outcome.cause.startswith("rank 1 on a failed (killed by SIGKILL; its output relay died with it")


class _Exited:
    """A transport whose node has exited, its pipes closed."""

    def __init__(self, host: str, job_id: str) -> None:
        self.host, self.job_id = host, job_id

    def poll(self) -> int:
        return 1

    def lost_link(self, silent_s: float) -> None:
        return None


def test_stopping_many_nodes_asks_every_node_at_once_and_waits_on_a_bounded_pool():
    from tests.harness import Concurrency
    from zerorun import config
    from zerorun.launch import supervisor as module
    from zerorun.launch.hostfile import Node
    from zerorun.launch.plan import MachineFacts, plan
    from zerorun.launch.supervisor import Supervisor

    counter, asked = Concurrency(), []

    class Counting(_Exited):
        def request_stop(self) -> None:
            asked.append(self.host)

        def stop(self, grace_s: float) -> int:
            assert len(asked) == 300  # every node heard "stop" before any is waited for
            with counter:
                return 0

    recipe = config.from_dict({"script": "/x/t.py"})
    nodes = [Node(f"n{i}", (0,)) for i in range(300)]
    launch_plan = plan(recipe, nodes, "j", 1, MachineFacts(2, "py"))
    Supervisor(launch_plan, [Counting(n.host, "j") for n in nodes])._stop_all()
    assert 1 < counter.most <= module.STOP_CONCURRENCY


@pytest.mark.slow
def test_a_raising_rank_comes_first_with_its_traceback_and_its_victim_gets_one_line(launch, tmp_path: Path):
    job = launch(TINY, ["--raise-rank", "1", "--raise-at", "2"], nproc_per_node=2, train={"steps": 50})
    assert job.wait(timeout=120) == 1, job.output
    stderr = job.stderr
    title = next(i for i, line in enumerate(stderr) if line.startswith("=" * 20 + " rank 1 on localhost failed"))
    assert not any("Traceback" in line or "torchrun" in line for line in stderr[:title]), "\n".join(stderr[:title])
    block = stderr[title:stderr.index(next(line for line in stderr[title + 1:] if line.startswith("====")))]
    assert block[1] == "the traceback of rank 1:" and block[2] == "[localhost:1] Traceback (most recent call last):"
    assert block[-1] == "[localhost:1] ValueError: bad batch on rank 1"
    assert not any(line.startswith("[localhost:0] Traceback") for line in stderr)  # held: in the failure log
    victims = [line for line in stderr if "(a victim)" in line]
    assert len(victims) <= 1 and all(line.startswith("zerorun: rank 0 on localhost (a victim): ") for line in victims)
    (log,) = (tmp_path / "runs" / "recipe").glob("failure-*.log")
    text = log.read_text()
    assert "==== rank 1 on localhost ====" in text and "ValueError: bad batch on rank 1" in text
    assert f"the whole output of every failed rank, and torchrun's report: {log.relative_to(tmp_path)}" in \
        "\n".join(stderr) or not victims
    assert _stopped_line(job).endswith("rank 1 on localhost failed (exit code 1); exit code 1")
    assert job.leftovers() == []


def test_the_culprits_traceback_is_printed_first_even_when_the_victims_came_first():
    """The supervisor's report from lines in the order the issue saw them: the victim's traceback and
    torchrun's report before the culprit's; only the culprit's is printed whole, each victim is one line."""
    import tempfile

    from zerorun import config
    from zerorun.launch.hostfile import Node
    from zerorun.launch.outcome import Output
    from zerorun.launch.plan import MachineFacts, plan
    from zerorun.launch.streams import EXIT_RECORD
    from zerorun.launch.supervisor import Supervisor

    class Captured(Output):
        def __init__(self) -> None:
            super().__init__()
            self.lines: list[str] = []

        def write(self, fd: int, line: bytes) -> None:
            self.lines.append(line.decode())

    victim = [b"[a:0] Traceback (most recent call last):", *(b"[a:0]   File \"x.py\", line %d, in f" % i
                                                           for i in range(30)),
              b"[a:0] RuntimeError: shared-memory collective: rank 1 (pid 7) exited while this rank waited for it"]
    torchrun = [b"E1127 api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 7) of binary: python",
                b"Traceback (most recent call last):", b"  File \"run.py\", line 1", b"ChildFailedError: ",
                b"=" * 60, b"zerorun.launch.worker FAILED"]
    culprit = [b"[a:1] Traceback (most recent call last):", b"[a:1]   File \"train.py\", line 8, in <module>",
               b"[a:1] ValueError: bad batch on rank 1"]
    records = [EXIT_RECORD + b'{"host": "a", "rank": 1, "code": 1, "signal": null}',
               EXIT_RECORD + b'{"host": "a", "rank": 0, "code": 1, "signal": null}']
    launch_plan = plan(config.from_dict({"script": "/x/t.py"}), [Node("a", (0, 1))], "j", 1, MachineFacts(2, "py"))
    output = Captured()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "runs" / "t" / "failure-j.log"
        supervisor = Supervisor(launch_plan, [_Exited("a", "j")], output=output, failure_log=log)
        for line in [*victim, *torchrun, *culprit, *records]:
            supervisor._handle(0, 2, line)
        assert output.lines == []  # every traceback held, and torchrun's report once a rank failed
        supervisor._report(supervisor._outcome_of_failure())
        text = log.read_text()
    assert output.lines[0] == "=" * 20 + " rank 1 on a failed (exit code 1) " + "=" * 20
    assert output.lines[1:5] == ["the traceback of rank 1:", *(line.decode() for line in culprit)]
    assert output.lines[6:] == [
        "zerorun: rank 0 on a (a victim): RuntimeError: shared-memory collective: rank 1 (pid 7) exited while this "
        "rank waited for it",
        f"zerorun: the whole output of every failed rank, and torchrun's report: {log}",
        "zerorun: job j stopped: rank 1 on a failed (exit code 1); exit code 1"]
    assert all(line.decode() in text for line in victim) and "[a:torchrun] zerorun.launch.worker FAILED" in text
    assert text.index("==== rank 1 on a ====") < text.index("==== rank 0 on a ====") < text.index("==== torchrun on a")


def test_a_traceback_a_rank_survives_is_printed_as_it_came():
    from zerorun.launch.held_output import HOLD_S, HeldOutput

    held = HeldOutput()
    assert not held.take(("a", 0), 1, b"[a:0] step 1", now=0.0)  # printed at once
    assert held.take(("a", 0), 2, b"[a:0] Traceback (most recent call last):", now=1.0)
    assert held.take(("a", 0), 1, b"[a:0] step 2", now=1.5)  # in order behind it
    assert held.release_stale(now=1.0 + HOLD_S / 2) == []
    assert held.release_stale(now=1.0 + HOLD_S) == [(2, b"[a:0] Traceback (most recent call last):"),
                                                     (1, b"[a:0] step 2")]
    assert not held.take(("a", 0), 1, b"[a:0] step 3", now=9.0)
