"""Real 2-worker CPU launches: output prefixes, exit codes, failure reports and teardown.

Each test runs `python -m zerorun.cli launch` as a subprocess on a recipe with kill_grace_s: 1,
and checks afterwards that no process of the job survives (by its ZERORUN_JOB_ID and by the pids
the scripts printed). The `stubborn.py` workers ignore SIGTERM and start a child that ignores it
too, so every teardown test also proves that SIGKILL and process groups reach them.
"""

from __future__ import annotations

import signal

import pytest

from zerorun.launch.failure_report import LOCAL_RANK_HINT

TEARDOWN_LIMIT_S = 10.0


def test_two_workers_all_reduce_and_every_line_is_prefixed_with_host_and_rank(launch):
    job = launch("allreduce.py", args=["--alpha", "1"])
    assert job.wait() == 0, job.output
    for rank in (0, 1):
        assert f"[localhost:{rank}] rank {rank} of 2 sum 1 args ['--alpha', '1']" in job.stdout
        assert f"[localhost:{rank}] rank {rank} raw fd write" in job.stdout  # C-level (fd 1) output too
        assert f"[localhost:{rank}] rank {rank} says hello on stderr" in job.stderr
    assert job.job_id is not None
    assert job.leftovers() == []


@pytest.mark.slow
def test_two_nodes_from_a_hostfile_get_global_ranks_in_hostfile_order(launch, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")  # two "nodes" on this machine: two torchruns
    job = launch("allreduce.py", flags=["--hostfile", str(hosts)])
    assert job.wait() == 0, job.output
    assert "[localhost:0] rank 0 of 2 sum 1 args []" in job.stdout
    assert "[127.0.0.1:1] rank 1 of 2 sum 1 args []" in job.stdout
    assert job.leftovers() == []


@pytest.mark.slow
def test_failing_rank_sets_exit_code_shows_its_last_lines_and_stops_stubborn_workers(launch):
    job = launch("stubborn.py", args=["--fail-rank", "1", "--code", "3"])
    code = job.wait()
    assert code == 3, job.output
    assert job.seconds_since("[localhost:1] rank 1 line 24") < TEARDOWN_LIMIT_S
    stderr = "\n".join(job.stderr)
    assert "rank 1 on localhost failed (exit code 3)" in stderr
    block = stderr[stderr.index("rank 1 on localhost failed"):]
    assert "[localhost:1] rank 1 line 24" in block and "[localhost:1] rank 1 line 5" in block
    assert "[localhost:1] rank 1 line 4" not in block  # the last 20 lines, not everything
    assert job.leftovers() == []


@pytest.mark.slow
def test_exception_in_script_prints_its_traceback_and_fails_the_job(launch):
    job = launch("stubborn.py", args=["--fail-rank", "0", "--raise-error"])
    assert job.wait() == 1, job.output
    stderr = "\n".join(job.stderr)
    assert "[localhost:0] Traceback (most recent call last):" in stderr
    assert "[localhost:0] RuntimeError: rank 0 fails on purpose" in stderr
    assert "stubborn.py" in stderr and "runpy" not in stderr  # the user's frames, not the bootstrap's
    assert "rank 0 on localhost failed (exit code 1)" in stderr, stderr  # the whole report when it fails
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_script_that_takes_no_local_rank_is_told_how_to_launch_without_it_and_then_runs(launch):
    compat = {"kill_grace_s": 1.0, "deepspeed_compat": True}  # `zerorun launch script.py`: DeepSpeed's launcher's ways
    job = launch("strict_args.py", args=["--steps", "3"], launch=compat)
    assert job.wait() == 2, job.output  # argparse's exit
    stderr = "\n".join(job.stderr)
    assert "unrecognized arguments: --local_rank=" in stderr, stderr
    assert f"zerorun: {LOCAL_RANK_HINT}" in job.stderr, stderr  # said once, on a line of its own
    job = launch("strict_args.py", args=["--steps", "3"], launch={**compat, "deepspeed_local_rank": False})
    assert job.wait() == 0, job.output  # what the hint says works
    assert "[localhost:1] parsed steps 3" in job.stdout
    assert job.leftovers() == []


@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_signal_to_launcher_stops_workers_that_ignore_sigterm_their_children_and_daemons(launch, sig, expected):
    job = launch("stubborn.py")
    job.wait_for("ready", count=2)
    assert len(job.worker_pids()) == 6  # two workers, a child and a daemon of each
    job.send(sig)
    assert job.wait() == expected, job.output
    assert job.seconds_since("signal") < TEARDOWN_LIMIT_S
    assert job.leftovers() == []


@pytest.mark.slow
def test_torchrun_failing_before_any_worker_starts_is_reported_with_its_output(launch):
    job = launch("allreduce.py", env={"PYTHON_EXEC": "/nonexistent/python"})  # torchrun execs workers with it
    assert job.wait() == 1, job.output
    stderr = "\n".join(job.stderr)
    assert "torchrun on localhost failed (exit code 1)" in stderr
    assert "[localhost:torchrun] FileNotFoundError" in stderr
    assert job.leftovers() == []
