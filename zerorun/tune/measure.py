"""What one trial measured: throughput and peak memory per rank from its telemetry records, and how it ended.

A trial's workers stream the usual telemetry (`zerorun/telemetry/probe.py`: `job`, `hello`,
`engine`, `step`, `sample`, `bye`) into `runs/<trial>/telemetry.jsonl`; `TrialRecords` is fed those
records as they arrive and answers the tuner's questions: how many steps are measured (the first
`warmup` steps of every rank are left out: start-up, first allocations, stage 3's order recording),
the throughput over them, the best single step (the optimistic bound early stopping compares), and
the peak memory per rank. All pure: records in, numbers out.
"""

from __future__ import annotations

import enum
import re
import statistics
from dataclasses import dataclass, field
from typing import Any

from zerorun.tune.load import Load
from zerorun.tune.space import Candidate


class Status(enum.Enum):
    """How a candidate ended up; only MEASURED candidates can win."""

    MEASURED = "measured"
    OVER_BUDGET = "over budget"  # ran, but its measured peak exceeds the memory budget
    OUT_OF_MEMORY = "out of memory"
    FAILED = "failed"
    INVALID = "invalid"  # the script did not run the candidate's batch (it ignores train.micro_batch_size)
    SLOWER = "stopped: slower"  # stopped early: its best step could not beat the best trial's mean
    OUT_OF_TIME = "stopped: budget"  # stopped when the tuning's time budget ran out
    STALLED = "stopped: no step"
    REJECTED = "rejected"  # not run: the estimate says it cannot fit, or it needs what is missing
    NOT_RUN = "not run"  # the search did not need it, or the budget ended first


@dataclass
class RankRecords:
    """One rank's steps (by global step number) and its memory peaks."""

    host: str | None = None
    pid: int | None = None
    pid_start: float | None = None
    steps: dict[int, tuple[float, int, int]] = field(default_factory=dict)  # step -> (seconds, tokens, samples)
    rss_peak: int = 0  # the largest sampled RSS
    hwm: int = 0  # the process's own high-water mark (VmHWM), where the tuner could read it
    gpu_peak: int | None = None  # CUDA max_memory_allocated

    def measured(self, warmup: int) -> list[tuple[float, int, int]]:
        return [v for step, v in sorted(self.steps.items()) if step > warmup]

    @property
    def peak_rss(self) -> int:
        return max(self.rss_peak, self.hwm)


@dataclass
class TrialRecords:
    """A trial's telemetry, as far as it has arrived."""

    world_size: int | None = None
    params: int | None = None
    ranks: dict[int, RankRecords] = field(default_factory=dict)

    def feed(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "job":
            self.world_size = record.get("world_size")
            return
        rank = record.get("rank")
        if not isinstance(rank, int):
            return
        state = self.ranks.setdefault(rank, RankRecords())
        if kind == "hello":
            state.host, state.pid, state.pid_start = record.get("host"), record.get("pid"), record.get("pid_start")
        elif kind == "engine":
            self.params = record.get("params") or self.params
        elif kind == "step" and record.get("step_time_s"):
            state.steps[int(record["step"])] = (float(record["step_time_s"]), int(record.get("tokens") or 0),
                                                int(record.get("samples") or 0))
        elif kind == "sample":
            state.rss_peak = max(state.rss_peak, int(record.get("rss") or 0))
            cuda = record.get("cuda")
            if cuda:
                state.gpu_peak = max(state.gpu_peak or 0, int(cuda.get("peak") or 0))

    # -- throughput -------------------------------------------------------------------------------

    def _reporting(self) -> list[RankRecords]:
        """Every rank, or none until every rank of the world has reported a step."""
        ranks = [r for r in self.ranks.values() if r.steps]
        return ranks if ranks and len(ranks) >= (self.world_size or 1) else []

    def measured_steps(self, warmup: int) -> int:
        """Steps after the warm-up that every rank has finished."""
        return min((len(r.measured(warmup)) for r in self._reporting()), default=0)

    def measured_seconds(self, warmup: int) -> float:
        return max((sum(s for s, _, _ in r.measured(warmup)) for r in self._reporting()), default=0.0)

    @property
    def unit(self) -> str:
        """tokens/s when the engine counted tokens (integer (batch, seq) inputs), else samples/s."""
        return "tokens/s" if any(t for r in self.ranks.values() for _, t, _ in r.steps.values()) else "samples/s"

    def _amount(self, step: tuple[float, int, int]) -> int:
        return step[1] if self.unit == "tokens/s" else step[2]

    def throughput(self, warmup: int) -> float | None:
        """The job's rate over the measured steps: each rank's amount over its time, summed over ranks."""
        ranks = self._reporting()
        n = self.measured_steps(warmup)
        if not n:
            return None
        total = 0.0
        for r in ranks:
            steps = r.measured(warmup)[:n]  # the same steps on every rank
            seconds = sum(s for s, _, _ in steps)
            total += sum(self._amount(s) for s in steps) / seconds
        return total

    def best_step(self, warmup: int) -> float | None:
        """The fastest single measured step of the job (its amount over all ranks / the slowest rank's time)."""
        ranks = self._reporting()
        n = self.measured_steps(warmup)
        rates = []
        for k in range(n):
            steps = [r.measured(warmup)[k] for r in ranks]
            rates.append(sum(self._amount(s) for s in steps) / max(s for s, _, _ in steps))
        return max(rates, default=None)

    def step_seconds(self, warmup: int) -> float | None:
        """The mean time of a measured step (the slowest rank's)."""
        n = self.measured_steps(warmup)
        return self.measured_seconds(warmup) / n if n else None

    def samples_per_step(self) -> set[int]:
        """The samples each rank processed per optimizer step, over every step seen (the engine counts them)."""
        return {samples for r in self.ranks.values() for _, _, samples in r.steps.values() if samples}

    # -- memory -----------------------------------------------------------------------------------

    @property
    def peak_rss(self) -> int | None:
        """The largest peak RSS of any rank."""
        return max((r.peak_rss for r in self.ranks.values()), default=0) or None

    @property
    def peak_gpu(self) -> int | None:
        return max((r.gpu_peak for r in self.ranks.values() if r.gpu_peak is not None), default=None)


@dataclass
class Trial:
    """One candidate's run (or why it did not run)."""

    candidate: Candidate
    status: Status
    phase: str = ""  # why the search ran it: baseline, sharding, micro-batch, checkpointing, bucket
    index: int | None = None  # t01, t02, ... in run order
    throughput: float | None = None
    unit: str = "tokens/s"
    best_step: float | None = None
    peak_rss: int | None = None
    peak_gpu: int | None = None
    steps: int = 0  # measured steps
    step_s: float | None = None
    wall_s: float = 0.0  # from start to the end of teardown
    ended_at: float | None = None  # time.time() when it ended (the sweep's drift correction places it by it)
    startup_s: float | None = None  # from start to the first step record
    cause: str = ""  # failure, rejection or stop reason
    params: int | None = None  # as the engine reported them
    samples_per_step: set[int] = field(default_factory=set)  # per rank, as the engine counted them
    log: str | None = None  # the trial's launcher output
    run_dir: str | None = None  # runs/<trial>: its telemetry.jsonl
    runs: list[float] = field(default_factory=list)  # with repeats: every run's throughput (the median is reported)
    repeats: list[int] = field(default_factory=list)  # the trial numbers of the repeats folded in
    loads: list[Load] = field(default_factory=list)  # the machine's load during each run

    @property
    def ok(self) -> bool:
        return self.status is Status.MEASURED

    def fold(self, repeat: Trial) -> None:
        """Take in another run of the same candidate: the throughput becomes the median of the runs, the
        peaks the largest; a repeat that failed makes the candidate failed (it cannot be trusted to train)."""
        assert repeat.candidate == self.candidate, "fold: a repeat is of the same candidate"
        self.runs = self.runs or [self.throughput or 0.0]
        self.repeats.append(repeat.index or 0)
        self.wall_s += repeat.wall_s
        self.loads += repeat.loads
        self.peak_rss = max(self.peak_rss or 0, repeat.peak_rss or 0) or None
        self.peak_gpu = max(self.peak_gpu or 0, repeat.peak_gpu or 0) or None
        if repeat.ok and repeat.throughput:
            self.runs.append(repeat.throughput)
            self.throughput = statistics.median(self.runs)
        else:
            self.status, self.cause = repeat.status, f"its repeat t{repeat.index:02d}: {repeat.cause}"


# ---------------------------------------------------------------------------------------------
# Why a trial failed, from the launcher's output

_ERROR_LINE = re.compile(r"^\[[^\]]+\] ((?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception)\b.*)$")
_FAILED_TITLE = re.compile(r"^=+ (rank \d+ on \S+ failed \(([^)]*)\)|.* failed \(exit code \d+\)) =+$")
_MODULE_PREFIX = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=\w+(?:Error|Exception)\b)")  # zerorun.errors.ZerorunError
_OOM = re.compile(r"out of memory|OutOfMemoryError|std::bad_alloc|Cannot allocate memory", re.I)


def failure_cause(output: str, exit_code: int) -> tuple[Status, str]:
    """(FAILED or OUT_OF_MEMORY, one line saying why) from a failed trial's launcher output.

    The launcher prints a failed rank's last lines after a `==== rank R on H failed (...) ====`
    title; the last exception line there is the cause. A rank killed by SIGKILL without a Python
    error is, on a training job, almost always the kernel's out-of-memory killer.
    """
    lines = output.splitlines()
    errors = [m.group(1) for m in map(_ERROR_LINE.match, lines) if m]
    titles = [m for m in map(_FAILED_TITLE.match, lines) if m]
    usage = [line.removeprefix("zerorun: error: ") for line in lines if line.startswith("zerorun: error: ")]
    if errors:
        cause = _MODULE_PREFIX.sub("", errors[-1])
    elif titles:
        cause = titles[-1].group(1)
    elif usage:
        cause = usage[-1]
    else:
        cause = f"the launcher exited with code {exit_code}" + (f": {lines[-1]}" if lines else "")
    if _OOM.search(cause) or any(_OOM.search(e) for e in errors):
        return Status.OUT_OF_MEMORY, cause
    if "killed by SIGKILL" in cause or (not errors and exit_code == 137):
        return Status.OUT_OF_MEMORY, f"{cause}: the kernel's out-of-memory killer, most likely"
    return Status.FAILED, cause
