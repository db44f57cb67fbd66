"""Jobs that survive a failure: real launches on two loopback SSH "hosts" (and one local node).

A rank killed mid-run restarts the job from its latest checkpoint and every step still runs, with
the losses after the resume equal to an uninterrupted run's; a lost node is dropped under
`shrink` and the job finishes on the other with twice the accumulation; a failure that repeats
stops with its cause named. No process is left anywhere in any case.
"""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

SCRIPT = "train_restartable.py"
STEPS = 8


def keys(tmp_path: Path, max_restarts: int = 1, **launch: object) -> dict:
    return {"train": {"steps": STEPS, "micro_batch_size": 4},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "every_steps": 2},
            "launch": {"kill_grace_s": 1.0, "transport": "ssh", "max_restarts": max_restarts, **launch},
            "telemetry": {"interval_s": 0.2}}


def losses(job) -> dict[tuple[int, int], str]:
    """(rank, step) -> the loss it printed, the last time it ran that step."""
    found = {}
    for line in job.stdout:
        match = re.search(r"\] rank (\d+) step (\d+) loss (\S+)$", line)
        if match:
            found[(int(match.group(1)), int(match.group(2)))] = match.group(3)
    return found


def checksums(job) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(2))
            for m in (re.search(r"\] rank (\d+) checksum (\S+)$", line) for line in job.stdout) if m}


@pytest.mark.slow
def test_a_killed_rank_restarts_from_the_last_checkpoint_and_matches_an_uninterrupted_run(launch_ssh, tmp_path):
    once = tmp_path / "failed-once"
    job = launch_ssh(SCRIPT, ["--fail-rank", "1", "--fail-at", "5", "--once", str(once)], nproc=1,
                     **keys(tmp_path / "a"))
    assert job.wait(timeout=300) == 0, job.output
    stderr = "\n".join(job.stderr)
    assert "rank 1 on 127.0.0.2 failed (killed by SIGKILL)" in stderr, job.output
    assert "zerorun: restart 1 of 1 on the same nodes" in stderr
    # how far the job got comes from telemetry, which may not have seen the killed rank's last steps
    assert re.search(r"zerorun: resuming from checkpoint step-4 in \S+; (telemetry last saw step 5; steps 5-5 run "
                     r"again|telemetry (last saw step [0-4]|saw no step), so it cannot say how far past step 4 the job got)",
                     stderr), job.output
    assert "[127.0.0.1:0] rank 0 resumed from step-4 at step 4" in job.stdout
    assert re.search(r"restart 1: rank 1 on 127.0.0.2 failed \(killed by SIGKILL\); resumed from step-4 at step 4, "
                     r"\d+ steps? run again; [\d.]+ s from the failure to the first step after it", stderr), job.output
    reference = launch_ssh(SCRIPT, nproc=1, **keys(tmp_path / "b", max_restarts=0))
    assert reference.wait(timeout=300) == 0, reference.output
    resumed, uninterrupted = losses(job), losses(reference)
    assert sorted(resumed) == sorted(uninterrupted) == [(r, s) for r in (0, 1) for s in range(STEPS)]
    assert resumed == uninterrupted  # bit for bit: same world size, the checkpoint holds every state
    assert checksums(job) == checksums(reference)
    assert job.leftovers() == [] and reference.leftovers() == []


@pytest.mark.slow
def test_shrink_drops_a_lost_host_and_finishes_on_the_other_with_the_global_batch_kept(launch_ssh, tmp_path):
    # the two-rank job holds before step 6 (after checkpoint step-6): on a slow machine it once finished all
    # 8 steps, with a step-8 checkpoint, before the lost link was acted on, and the shrunken job had nothing to run
    job = launch_ssh(SCRIPT, ["--hold-at", "6", "--hold-world", "2"], nproc=1,
                     **keys(tmp_path, on_node_failure="shrink"))
    job.wait_until(lambda: any("rank 1 holds before step 6" in line for line in job.stdout),
                   "the second host holding before step 6", timeout=240)
    client = next(p for p in psutil.Process(job.proc.pid).children() if p.name() == "ssh" and "127.0.0.2" in p.cmdline())
    client.kill()  # the link to the second host is gone
    assert job.wait(timeout=300) == 0, job.output
    stderr = "\n".join(job.stderr)
    assert "lost contact with 127.0.0.2: its ssh client was killed (SIGKILL)" in stderr
    assert ("zerorun: restart 1 of 1 without 127.0.0.2: 2 -> 1 nodes, 2 -> 1 ranks; global batch 8 kept: "
            "train.micro_batch_size 4, train.grad_accum_steps 1 -> 2") in stderr, job.output
    after = [line for line in job.stdout if re.search(r"\] rank 0 step (\d+) loss", line)]
    assert after[-1].startswith("[127.0.0.1:0] rank 0 step 7 loss")  # steps 6 and 7, on the first host alone
    assert "[127.0.0.1:0] rank 0 resumed from step-6 at step 6" in job.stdout, job.output
    assert not any(line.startswith("[127.0.0.2") for line in job.stdout[job.stdout.index(next(
        line for line in job.stdout if "resumed from" in line)):])
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_failure_that_repeats_at_the_same_step_stops_the_job_and_names_it(launch_ssh, tmp_path):
    job = launch_ssh(SCRIPT, ["--fail-rank", "1", "--fail-at", "5", "--code", "3"], nproc=1,
                     **keys(tmp_path, max_restarts=3))
    assert job.wait(timeout=300) == 3, job.output
    stderr = "\n".join(job.stderr)
    assert stderr.count("rank 1 on 127.0.0.2 failed (exit code 3)") >= 2
    assert ("zerorun: rank 1 on 127.0.0.2 failed again after step 5, as in the attempt before: not restarting a "
            "failure that repeats (rank 1 on 127.0.0.2 failed (exit code 3))") in stderr, job.output
    assert "restart 2 of" not in stderr  # (not the time line: "down 1.5, restart 2.3, start 13.4")
    assert job.leftovers() == []


@pytest.mark.slow
def test_a_local_job_restarts_too(launch, tmp_path):
    recipe = keys(tmp_path)
    recipe["launch"]["transport"] = "local"
    job = launch(SCRIPT, ["--fail-rank", "1", "--fail-at", "3", "--once", str(tmp_path / "once")],
                 nproc_per_node=2, **recipe)
    assert job.wait(timeout=300) == 0, job.output
    assert "[localhost:1] rank 1 resumed from step-2 at step 2" in job.stdout
    assert losses(job).keys() == {(r, s) for r in (0, 1) for s in range(STEPS)}
    assert job.leftovers() == []
