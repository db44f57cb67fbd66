"""Multi-node launches over SSH on a private sshd: two loopback addresses are two "hosts".

Every node runs under its node supervisor (`zerorun.launch.node`) through a real `ssh`. Both
hosts are this machine, so "nothing left on either host" means no live process carrying the
job's ZERORUN_JOB_ID (and none of the pids the workers printed).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import psutil
import pytest

from tests.launch.launched import subprocess_env
from zerorun import config
from zerorun.launch import preflight
from zerorun.launch.hostfile import Node
from zerorun.launch.plan import MachineFacts, plan

TEARDOWN_LIMIT_S = 15.0


@pytest.mark.slow
def test_two_ssh_nodes_all_reduce_with_host_rank_prefixes_and_telemetry_from_both(launch_ssh):
    job = launch_ssh("allreduce.py", nproc=1)
    assert job.wait() == 0, job.output
    assert "[127.0.0.1:0] rank 0 of 2 sum 1 args []" in job.stdout
    assert "[127.0.0.2:1] rank 1 of 2 sum 1 args []" in job.stdout
    assert "[127.0.0.2:1] rank 1 says hello on stderr" in job.stderr
    summary = [line.split()[:2] for line in job.stderr if line.startswith("127.0.0.")]
    assert ["127.0.0.1", "0"] in summary and ["127.0.0.2", "1"] in summary, job.output  # the telemetry table
    assert job.leftovers() == []


def _numbers(text: str) -> tuple[float, float]:
    """(final loss, checksum) from "rank R of W final loss L checksum C"."""
    words = text.split()
    return float(words[words.index("loss") + 1]), float(words[words.index("checksum") + 1])


def _results(job) -> dict[int, str]:
    """rank -> "final loss ... checksum ..." from the train_tiny.py lines (the prefix dropped)."""
    found = {}
    for line in job.stdout:
        if "final loss" in line:
            text = line.split("] ", 1)[1]
            found[int(text.split()[1])] = text
    return found


@pytest.mark.slow
def test_two_ssh_nodes_by_two_ranks_train_like_one_local_node_of_four(launch, launch_ssh):
    keys = {"train": {"steps": 4}, "zero": {"stage": 2}, "telemetry": {"enabled": False}}
    over_ssh = launch_ssh("train_tiny.py", nproc=2, **keys)
    assert over_ssh.wait() == 0, over_ssh.output
    one_node = launch("train_tiny.py", nproc_per_node=4, **keys,
                      launch={"kill_grace_s": 1.0, "oversubscribe": True})  # 4 ranks on the 2-core CI machine
    assert one_node.wait() == 0, one_node.output
    assert sorted(_results(over_ssh)) == [0, 1, 2, 3]
    # Two nodes of two ranks reduce hierarchically (the node's sum first, then across nodes): the same
    # gradients summed in another order, so fp32 rounding may differ in the last bits (seen: 8e-11
    # relative on the parameter checksum after 4 steps). A wrong sum (a rank's share lost or counted
    # twice) moves them by far more than 1e-6.
    for rank, text in _results(over_ssh).items():
        ssh_loss, ssh_sum = _numbers(text)
        node_loss, node_sum = _numbers(_results(one_node)[rank])
        assert ssh_loss == pytest.approx(node_loss, rel=1e-6) and ssh_sum == pytest.approx(node_sum, rel=1e-6), \
            (text, _results(one_node)[rank])
    assert any(line.startswith("[127.0.0.2:3] rank 3 of 4 final loss") for line in over_ssh.stdout)
    assert over_ssh.leftovers() == [] and one_node.leftovers() == []


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _no_leftovers_within(job, seconds: float) -> list[psutil.Process]:
    """The job's live processes once they are all gone, or after `seconds` (what is still alive)."""
    deadline = time.monotonic() + seconds
    while (left := job.leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_signal_to_launcher_stops_stubborn_workers_on_every_ssh_node(launch_ssh, sig, expected):
    job = launch_ssh("stubborn.py", nproc=1)
    job.wait_for("ready", count=2)
    assert len(job.worker_pids()) == 6  # per node: a worker, its child and a daemon
    job.send(sig)
    assert job.wait() == expected, job.output
    assert job.seconds_since("signal") < TEARDOWN_LIMIT_S
    assert job.leftovers() == []


@pytest.mark.slow
def test_launcher_killed_with_sigkill_leaves_nothing_on_either_host(launch_ssh):
    job = launch_ssh("stubborn.py", nproc=1)
    job.wait_for("ready", count=2)
    clients = [p for p in psutil.Process(job.proc.pid).children() if p.name() == "ssh"]
    assert len(clients) == 2
    job.proc.kill()  # no teardown from the launcher: its ssh clients get SIGTERM (parent-death signal)
    job.wait()
    assert _no_leftovers_within(job, TEARDOWN_LIMIT_S) == []
    assert not any(_alive(client) for client in clients)


@pytest.mark.slow
def test_ssh_client_killed_with_sigkill_ends_the_job_on_both_hosts(launch_ssh):
    job = launch_ssh("stubborn.py", nproc=1)
    job.wait_for("ready", count=2)
    clients = [p for p in psutil.Process(job.proc.pid).children() if p.name() == "ssh"]
    dropped = next(p for p in clients if "127.0.0.2" in p.cmdline())
    dropped.kill()  # SIGKILL: the connection to 127.0.0.2 drops without a word
    started = time.monotonic()
    assert job.wait(timeout=TEARDOWN_LIMIT_S + 10) != 0, job.output
    stderr = "\n".join(job.stderr)
    assert "job " + str(job.job_id) + " stopped: lost contact with 127.0.0.2: its ssh client was killed (SIGKILL)" \
        in stderr, job.output
    assert "rank 0" not in stderr.split("stopped:")[-1]  # never the rank on the other host
    assert _no_leftovers_within(job, TEARDOWN_LIMIT_S) == []
    assert time.monotonic() - started < TEARDOWN_LIMIT_S


@pytest.mark.slow
def test_failing_remote_rank_sets_exit_code_and_stops_both_hosts(launch_ssh):
    job = launch_ssh("stubborn.py", args=["--fail-rank", "1", "--code", "3"], nproc=1)
    assert job.wait() == 3, job.output
    stderr = "\n".join(job.stderr)
    assert "rank 1 on 127.0.0.2 failed (exit code 3)" in stderr
    assert "[127.0.0.2:1] rank 1 line 24" in stderr[stderr.index("rank 1 on 127.0.0.2 failed"):]
    assert job.leftovers() == []


@pytest.mark.slow
def test_preflight_names_an_unreachable_host_in_one_table_and_starts_nothing(launch, sshd, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 slots=1\n127.0.0.3 slots=1\n")  # nothing listens on 127.0.0.3
    job = launch("allreduce.py", flags=["--hostfile", str(hosts)], ssh=sshd.recipe_section(),
                 launch={"transport": "ssh"})
    assert job.wait(timeout=60) != 0
    stderr = "\n".join(job.stderr)
    assert "preflight failed on 1 of 2 host(s); nothing was started." in stderr, job.output
    assert "Connection refused" in stderr and "unreachable over ssh" in stderr
    table = stderr[stderr.index("host  "):]
    assert "(launcher)" in table and "127.0.0.1" in table and "ok" in table
    assert not any("rank" in line for line in job.stdout)


@pytest.mark.slow
def test_preflight_reports_version_differences_and_a_missing_script(sshd, tmp_path):
    recipe = config.from_dict({"script": str(tmp_path / "gone.py"), "ssh": sshd.recipe_section(),
                               "launch": {"transport": "ssh"}})
    facts = MachineFacts(cpu_count=2, python=sys.executable, inherited_env=subprocess_env(),
                         cwd=str(tmp_path))
    launch_plan = plan(recipe, [Node("127.0.0.2", (0,))], "job-pre", 29500, facts)
    expected = {**preflight.local_facts(), "torch": "1.0.0"}
    missing = tmp_path / "no-nvme"
    check = preflight.check_host(launch_plan, launch_plan.nodes[0], recipe.script, expected,
                                 {"zero.offload_optimizer.nvme_path": str(missing)})
    assert check.problem == (f"torch {check.torch} here, 1.0.0 on the launcher; no script {recipe.script}; "
                             f"zero.offload_optimizer.nvme_path: {missing} does not exist; create it on a local "
                             f"NVMe disk (mkdir -p {missing}) or point zero.offload_optimizer.nvme_path at an "
                             "existing directory.")
    assert (check.python, check.zerorun, check.script) == (expected["python"], expected["zerorun"], False)
    assert "127.0.0.2" in preflight.render([check], expected, recipe.script)


FAKE_SSH = """#!/bin/sh
# A node over "ssh": logs its start (s), connects once the test says go, logs that (u), then beats
# back for every line it reads and ends on `stop`.
echo s >> "$FAKE_SSH_LOG"
while [ ! -e "$FAKE_SSH_GO" ]; do sleep 0.1; done
echo u >> "$FAKE_SSH_LOG"
while read -r line; do
    [ "$line" = stop ] && exit 0
    printf '\\036zerorun-beat\\n' >&2
done
"""


@pytest.mark.slow
def test_a_job_on_300_ssh_hosts_runs_on_two_threads_and_connects_a_bounded_number_at_once(tmp_path, monkeypatch):
    import signal
    import threading

    from zerorun.launch import supervisor as module
    from zerorun.launch.launcher import transport_for
    from zerorun.launch.supervisor import STOP_CONCURRENCY, Output, Supervisor

    ssh, log, go = tmp_path / "ssh", tmp_path / "ssh.log", tmp_path / "go"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SSH_LOG", str(log))
    monkeypatch.setenv("FAKE_SSH_GO", str(go))
    monkeypatch.setattr(module, "START_CONCURRENCY", 32)
    recipe = config.from_dict({"script": "/x/t.py", "launch": {"kill_grace_s": 1.0}})
    nodes = [Node(f"node-{i}", (0,)) for i in range(300)]
    launch_plan = plan(recipe, nodes, "j", 1, MachineFacts(2, "py"))
    transports = [transport_for(node, launch_plan) for node in launch_plan.nodes]
    before = set(threading.enumerate())  # by identity: a thread an earlier test left may end during this one

    def started() -> int:
        return len(set(threading.enumerate()) - before)

    class Watching(Output):
        """Counts threads while the job runs; a second into it lets the nodes connect, and once every
        node is up stops the job as a SIGTERM would."""

        def __init__(self) -> None:
            super().__init__()
            self.running, self.stopping, self.first_tick, self.connecting = 0, 0, 0.0, 0

        def tick(self) -> None:
            if supervisor._signals:
                self.stopping = max(self.stopping, started())
                return
            self.running = max(self.running, started())
            log_text = log.read_text() if log.exists() else ""
            self.first_tick = self.first_tick or time.monotonic()
            if not go.exists() and time.monotonic() - self.first_tick > 1.0:
                self.connecting = log_text.count("s")  # started, none connected yet
                go.touch()
            if log_text.count("u") == len(nodes):
                supervisor._signals.append(signal.SIGTERM)

    watching = Watching()
    supervisor = Supervisor(launch_plan, transports, output=watching)
    assert supervisor.run() == 143
    assert supervisor.outcome.cause == "stopped by SIGTERM"  # no node was lost: every one beat back
    assert watching.running == 2  # the output reader and the heartbeats
    assert watching.stopping <= 2 + STOP_CONCURRENCY
    assert 1 < watching.connecting <= 32
    assert all(t.poll() == 0 for t in transports)  # every fake ssh ended on `stop`
