"""A trial's figures from its telemetry records, and its failure cause from the launcher's output."""

from __future__ import annotations

import pytest

from zerorun.tune.measure import Status, Trial, TrialRecords, failure_cause


def step(rank: int, number: int, seconds: float, tokens: int = 256, samples: int = 2) -> dict:
    return {"type": "step", "rank": rank, "step": number, "step_time_s": seconds, "tokens": tokens, "samples": samples}


def records(*items: dict, world: int = 2) -> TrialRecords:
    fed = TrialRecords()
    for record in ({"type": "job", "world_size": world}, *items):
        fed.feed(record)
    return fed


def test_warm_up_steps_are_left_out_and_ranks_add_up() -> None:
    r = records(step(0, 1, 9.0), step(1, 1, 9.0), step(0, 2, 1.0), step(1, 2, 2.0), step(0, 3, 1.0), step(1, 3, 2.0))
    assert r.measured_steps(warmup=1) == 2
    assert r.throughput(warmup=1) == pytest.approx(512 / 2.0 + 512 / 4.0)  # the 9 s first step is not in it
    assert r.best_step(warmup=1) == pytest.approx(512 / 2.0)  # both ranks' tokens over the slower rank's time
    assert r.step_seconds(warmup=1) == pytest.approx(2.0)
    assert r.throughput(warmup=3) is None


def test_nothing_is_measured_until_every_rank_of_the_world_reported() -> None:
    r = records(step(0, 1, 1.0), step(0, 2, 1.0), step(0, 3, 1.0))
    assert r.measured_steps(0) == 0 and r.throughput(0) is None and r.best_step(0) is None
    r.feed(step(1, 1, 1.0))
    assert r.measured_steps(0) == 1  # steps every rank has finished
    assert r.throughput(0) == pytest.approx(512.0)


def test_a_repeated_step_record_counts_once() -> None:
    r = records(step(0, 2, 1.0), step(0, 2, 1.0), step(1, 2, 1.0), world=2)
    assert r.measured_steps(1) == 1


def test_inputs_without_tokens_are_measured_in_samples() -> None:
    r = records(step(0, 1, 0.5, tokens=0, samples=4), step(1, 1, 0.5, tokens=0, samples=4))
    assert r.unit == "samples/s" and r.throughput(0) == pytest.approx(16.0)


def test_peak_memory_is_the_largest_of_the_samples_and_the_high_water_mark() -> None:
    r = records({"type": "hello", "rank": 0, "host": "localhost", "pid": 1, "pid_start": 0.0},
                {"type": "sample", "rank": 0, "rss": 100, "cuda": None},
                {"type": "sample", "rank": 1, "rss": 300, "cuda": {"peak": 70, "allocated": 1}},
                {"type": "sample", "rank": 0, "rss": 200, "cuda": None},
                {"type": "engine", "rank": 0, "params": 1234})
    assert r.peak_rss == 300 and r.peak_gpu == 70 and r.params == 1234
    r.ranks[0].hwm = 450  # what /proc/<pid>/status said between two samples
    assert r.peak_rss == 450


def test_the_samples_per_step_are_those_the_engine_counted() -> None:
    assert records(step(0, 1, 1.0, samples=16), step(1, 1, 1.0, samples=8)).samples_per_step() == {8, 16}


FAILED_RANK = """\
zerorun: job t-1: 1 node, 2 workers, master 127.0.0.1:1234
[localhost:0] step 0 loss 6.2
==================== rank 1 on localhost failed ({how}) ====================
last 3 lines of rank 1:
[localhost:1] Traceback (most recent call last):
[localhost:1]   File "train.py", line 3, in <module>
{error}
=====================================================
zerorun: job t-1 stopped: rank 1 on localhost failed; exit code 1
"""


@pytest.mark.parametrize("error, how, status, cause", [
    ("[localhost:1] zerorun.errors.ZerorunError: zero.offload_optimizer.nvme_path: /x does not exist", "exit code 1",
     Status.FAILED, "ZerorunError: zero.offload_optimizer.nvme_path: /x does not exist"),
    ("[localhost:1] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "exit code 1",
     Status.OUT_OF_MEMORY, "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("[localhost:1] RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes. "
     "Error code 12 (Cannot allocate memory)", "exit code 1", Status.OUT_OF_MEMORY, None),
    ("[localhost:1] (no error line)", "killed by SIGKILL", Status.OUT_OF_MEMORY,
     "rank 1 on localhost failed (killed by SIGKILL): the kernel's out-of-memory killer, most likely"),
])
def test_a_failed_trials_cause_is_its_last_error_line(error: str, how: str, status: Status, cause: str | None) -> None:
    got_status, got_cause = failure_cause(FAILED_RANK.format(error=error, how=how), 1)
    assert got_status is status
    assert got_cause == (cause or error.split("] ", 1)[1])


def test_a_launcher_error_is_the_cause_when_no_rank_ran() -> None:
    output = "zerorun: error: recipe.yaml:3: zero.stage: must be >= 0 and <= 3, got 7.\n"
    assert failure_cause(output, 2) == (Status.FAILED, "recipe.yaml:3: zero.stage: must be >= 0 and <= 3, got 7.")
    assert failure_cause("", 1) == (Status.FAILED, "the launcher exited with code 1")


def test_a_repeat_that_fails_means_the_candidate_cannot_win() -> None:
    from zerorun.tune.space import Candidate

    c = Candidate(2, "none", "none", 2, 1, False, 25.0)
    trial = Trial(c, Status.MEASURED, index=1, throughput=100.0, peak_rss=10)
    trial.fold(Trial(c, Status.MEASURED, index=5, throughput=120.0, peak_rss=30))
    assert trial.ok and trial.throughput == 110.0 and trial.peak_rss == 30 and trial.repeats == [5]
    trial.fold(Trial(c, Status.OUT_OF_MEMORY, index=7, cause="killed by SIGKILL"))
    assert trial.status is Status.OUT_OF_MEMORY and trial.cause == "its repeat t07: killed by SIGKILL"
