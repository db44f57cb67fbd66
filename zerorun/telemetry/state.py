"""The state of a job as the records describe it: the latest figures per rank, and running totals.

One `RunState` is fed record by record, live by the collector (`now` = the launcher's clock when
the record arrived) or afterwards by `zerorun report` (`now` = the record's own `t`), so the live
view, the final summary and the report all come from the same arithmetic.

Throughput totals leave out each rank's first step: it includes start-up (engine construction,
first allocations, kernel warm-up) and would drag the means of short runs down.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from zerorun.telemetry.restarts import Restart

MAX_STALLS = 100  # stall reports kept in memory


@dataclass(frozen=True)
class DeclaredTotal:
    """A rank's engine said how many steps its script runs: `steps`, or None when that is not known (a
    DeepSpeed-API script driving its own loop, with no scheduler total in its config)."""

    steps: int | None


@dataclass
class RankState:
    """What one rank reported last, plus its running totals."""

    rank: int
    host: str = "?"
    pid: int | None = None
    pid_start: float | None = None
    finished: bool = False  # said `bye`
    params: int | None = None
    peak_tflops: float | None = None
    # the latest step
    step: int = 0
    loss: float | None = None
    grad_norm: float | None = None
    loss_scale: float | None = None
    step_time_s: float | None = None
    kernel_build_s: float = 0.0  # of the latest step's time, building a kernel (set-up, not the steps' pace)
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    skipped_total: int = 0
    comm: dict[str, dict[str, float]] = field(default_factory=dict)
    offload: dict[str, dict[str, float]] = field(default_factory=dict)  # d2h, h2d, nvme_read/write, wait
    # the latest sample
    rss: int | None = None
    rss_peak: int = 0
    cpu_percent: float | None = None
    device_now: int | None = None  # CUDA allocated, or on CPU the bytes the engine holds
    device_peak: int = 0
    cuda: bool = False
    memory: dict[str, dict[str, int]] | None = None
    nvme_bytes: int = 0
    io_rate: float | None = None  # block-device bytes/s between the last two samples
    io_bytes: int = 0  # since the first sample
    where: dict[str, Any] | None = None
    last_sample_at: float | None = None
    checkpoints: int = 0  # saves committed (`checkpoint` records)
    checkpoint_stall_s: float = 0.0  # seconds the training loop waited for them, in all
    checkpoint_last: dict[str, Any] | None = None  # the latest `checkpoint` record
    first_step: int | None = None  # the step number of the first step this job reported (after a resume: > 1)
    declared_total: DeclaredTotal | None = None  # what the rank's engine said of the steps the script runs
    # totals over steps after the first
    steps_seen: int = 0
    timed_s: float = 0.0
    timed_samples: int = 0
    timed_tokens: int = 0
    timed_flops: float = 0.0
    _comm_first: tuple[float, float] = (0.0, 0.0)  # (waited, in flight) seconds at the first step
    _io_first: int | None = None
    _io_last: tuple[float, int] | None = None

    def ingest(self, record: dict[str, Any], now: float) -> None:
        kind = record.get("type")
        if kind == "hello":
            self.host = str(record.get("host", self.host))
            self.pid, self.pid_start = record.get("pid"), record.get("pid_start")
        elif kind == "engine":
            self.params, self.peak_tflops = record.get("params"), record.get("peak_tflops")
            if "total_steps" in record:  # (an engine of older zerorun did not say: the launcher's figure stands)
                self.declared_total = DeclaredTotal(record["total_steps"])
        elif kind == "step":
            self._step(record)
        elif kind == "sample":
            self._sample(record, now)
        elif kind == "checkpoint":
            self.checkpoints += 1
            self.checkpoint_stall_s += float(record.get("stall_s") or 0.0)
            self.checkpoint_last = record
        elif kind == "bye":
            self.finished = True

    def _step(self, r: dict[str, Any]) -> None:
        step = int(r.get("step", 0))
        if step <= self.step and self.steps_seen:
            return  # a repeat after a reconnect
        if self.first_step is None:
            self.first_step = step
            self._comm_first = _comm_totals(r.get("comm") or {})
        if self.steps_seen and r.get("step_time_s"):
            self.timed_s += r["step_time_s"]
            self.timed_samples += r.get("samples") or 0
            self.timed_tokens += r.get("tokens") or 0
            self.timed_flops += r.get("flops") or 0.0
        self.steps_seen += 1
        self.step = step
        for key in ("loss", "grad_norm", "loss_scale", "step_time_s", "samples_per_s", "tokens_per_s", "tflops",
                    "mfu"):
            setattr(self, key, r.get(key))
        self.kernel_build_s = float(r.get("kernel_build_s") or 0.0)
        self.skipped_total = int(r.get("skipped_total") or 0)
        self.comm = r.get("comm") or self.comm
        self.offload = r.get("offload") or self.offload

    def _sample(self, r: dict[str, Any], now: float) -> None:
        self.last_sample_at = now
        self.rss = r.get("rss")
        self.rss_peak = max(self.rss_peak, self.rss or 0)
        self.cpu_percent = r.get("cpu_percent")
        self.memory = r.get("memory") or self.memory
        self.where = r.get("where") or self.where  # the last sample, after the script ended, has none
        cuda = r.get("cuda")
        self.cuda = cuda is not None
        if cuda is not None:
            self.device_now = cuda.get("allocated")
            self.device_peak = max(self.device_peak, cuda.get("peak") or 0)
        elif self.memory is not None:
            self.device_now = held_bytes(self.memory)
            self.device_peak = max(self.device_peak, self.device_now)
        if self.memory is not None:
            self.nvme_bytes = sum(places.get("nvme", 0) for places in self.memory.values())
        io = r.get("io")
        if io is not None:
            total = int(io.get("read_bytes", 0)) + int(io.get("write_bytes", 0))
            t = float(r.get("t", now))
            if self._io_first is None:
                self._io_first = total
            if self._io_last is not None and t > self._io_last[0]:
                self.io_rate = (total - self._io_last[1]) / (t - self._io_last[0])
            self._io_last = (t, total)
            self.io_bytes = total - self._io_first

    # -- derived ---------------------------------------------------------------------------------

    def mean(self, amount: float) -> float | None:
        """`amount` per second over the timed steps (None before the second step)."""
        return amount / self.timed_s if self.timed_s > 0 else None

    @property
    def comm_waited_s(self) -> float | None:
        """Seconds the training thread blocked in collectives over the timed steps (what compute did not
        hide); None from workers that do not count it."""
        if not self.comm or any("waited" not in kind for kind in self.comm.values()):
            return None
        return _comm_totals(self.comm)[0] - self._comm_first[0]

    @property
    def comm_in_flight_s(self) -> float:
        """Seconds collectives were in flight over the timed steps, launch to wait(): overlapping
        collectives each count, so this can exceed the step time when overlap works."""
        return _comm_totals(self.comm)[1] - self._comm_first[1]

    @property
    def offload_waited_s(self) -> float:
        return float(self.offload.get("wait", {}).get("seconds", 0.0))

    @property
    def waiting(self) -> bool:
        """Whether the training thread was last seen inside a collective (waiting for other ranks)."""
        return bool(self.where and self.where.get("in_collective"))

    def describe_where(self) -> str:
        if not self.where:
            return "no sample yet"
        w = self.where
        spot = f"in {w.get('function')} ({os.path.basename(str(w.get('file')))}:{w.get('line')})"
        return spot + (f"; its last collective: {w['collective']}" if w.get("collective") else "")


def _comm_totals(comm: dict[str, dict[str, float]]) -> tuple[float, float]:
    """(waited, in flight) seconds summed over the collective kinds of cumulative counters."""
    return (sum(float(k.get("waited", 0.0)) for k in comm.values()),
            sum(float(k.get("seconds", 0.0)) for k in comm.values()))


MODEL_STATE_KINDS = ("params", "grads", "master", "optimizer")  # as runtime.memory (a test keeps them equal)


def held_bytes(memory: dict[str, dict[str, int]]) -> int:
    """What the engine holds in memory (every kind and place but NVMe): a CPU rank's "device" bytes."""
    return sum(b for kind in memory.values() for place, b in kind.items() if place != "nvme")


def model_state_bytes(memory: dict[str, dict[str, int]] | None) -> int | None:
    """params + grads + master + optimizer, every place: what the ZeRO formulas describe."""
    if memory is None:
        return None
    return sum(b for kind in MODEL_STATE_KINDS for b in memory.get(kind, {}).values())


@dataclass(frozen=True)
class Culprit:
    """The rank that held the others up when one of them failed waiting, and what the telemetry showed."""

    rank: int
    host: str
    why: str  # "stopped making progress at step 2, in sleep_here (train.py:39)"
    evidence: tuple[str, ...]  # one line per rank: step, where, waiting or silent


@dataclass
class RunState:
    """The whole job: the launcher's header, every rank, progress and stalls."""

    job: dict[str, Any] = field(default_factory=dict)
    ranks: dict[int, RankState] = field(default_factory=dict)
    exit_code: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    engine_at: float | None = None  # when the first engine was built (stall detection starts then)
    last_step_at: float | None = None  # when any rank last finished a step
    stalls: list[dict[str, Any]] = field(default_factory=list)
    restarts: list[Restart] = field(default_factory=list)

    def ingest(self, record: dict[str, Any], now: float) -> None:
        kind = record.get("type")
        if kind == "restart":
            self._restart(record)
            return
        if kind == "job":
            self.job = dict(record)
            self.started_at = float(record.get("t", now))
            return
        if kind == "end":
            self.exit_code = record.get("exit_code")
            self.ended_at = float(record.get("t", now))
            return
        if kind == "stall":
            self.stalls.append(dict(record))
            del self.stalls[:-MAX_STALLS]  # the latest ones: a job stalled for days keeps a bounded history
            return
        rank = record.get("rank")
        if not isinstance(rank, int):
            return
        state = self.ranks.setdefault(rank, RankState(rank))
        before = state.step
        state.ingest(record, now)
        if kind == "engine" and self.engine_at is None:
            self.engine_at = now
        if kind == "step" and state.step > before:
            self.last_step_at = now
        if self.restarts:
            stepped = len(self.ranks) >= self.world_size and all(r.steps_seen for r in self.ranks.values())
            self.restarts[-1].saw(record, now, stepped)

    def _restart(self, record: dict[str, Any]) -> None:
        """A new attempt: the ranks start over (possibly fewer of them); the failure is kept with its gap."""
        self.restarts.append(Restart.from_record(record, self.step))
        self.job["world_size"] = record.get("world_size", self.job.get("world_size"))
        self.ranks = {}
        self.engine_at = self.last_step_at = None

    # -- progress --------------------------------------------------------------------------------

    @property
    def total_steps(self) -> int | None:
        """The steps the job's script runs, where known: what the engines said (a script that drives its
        own loop may not know), else the launcher's figure (the recipe's train.steps); None: no total."""
        declared = [r.declared_total for r in self.ranks.values() if r.declared_total is not None]
        if declared:
            totals = [d.steps for d in declared if d.steps]
            return max(totals) if totals else None
        steps = self.job.get("steps")
        return int(steps) if steps else None

    @property
    def world_size(self) -> int:
        return int(self.job.get("world_size") or len(self.ranks))

    @property
    def step(self) -> int:
        """Steps every reporting rank has finished."""
        return min((r.step for r in self.ranks.values()), default=0)

    @property
    def first_step(self) -> int | None:
        """The first step this job ran (1, or the one after the checkpoint it resumed from)."""
        return min((r.first_step for r in self.ranks.values() if r.first_step is not None), default=None)

    def eta_s(self, now: float) -> float | None:
        """Steps left times the slowest rank's mean step time, less the time since the last step.

        Step times come from the workers, so no clock is compared across machines. The first step's time is
        taken without the kernel build it may have included (the next steps build nothing).
        """
        step_times = [r.timed_s / (r.steps_seen - 1) if r.steps_seen > 1 else
                      (r.step_time_s - r.kernel_build_s if r.step_time_s else None) for r in self.ranks.values()]
        step_times = [t for t in step_times if t]
        total = self.total_steps
        if not total or not step_times or self.last_step_at is None:
            return None
        left = max(0, total - self.step) * max(step_times)
        return max(0.0, left - (now - self.last_step_at)) if left else 0.0

    def elapsed_s(self, now: float) -> float:
        return (self.ended_at or now) - self.started_at if self.started_at is not None else 0.0

    def sorted_ranks(self) -> list[RankState]:
        return [self.ranks[r] for r in sorted(self.ranks)]

    # -- stalls ----------------------------------------------------------------------------------

    def culprit(self, failed_rank: int) -> Culprit | None:
        """When `failed_rank` failed while waiting in a collective: the rank it waited for.

        That is a rank whose telemetry stopped well before the failed rank's (a stopped or frozen
        process), else one behind it in steps, else, at equal steps, one that was not inside a
        collective (a hang in the script). None when the failed rank was not waiting, or no rank stands out.
        """
        failed = self.ranks.get(failed_rank)
        if failed is None or not failed.waiting or failed.last_sample_at is None:
            return None
        others = [r for r in self.sorted_ranks() if r.rank != failed_rank]
        silent_after = max(5.0, 5 * float(self.job.get("interval_s") or 1.0))

        def silence(r: RankState) -> float:
            return failed.last_sample_at - r.last_sample_at if r.last_sample_at is not None else 0.0

        frozen = [r for r in others if not r.finished and silence(r) > silent_after]
        behind = [r for r in others if r.step < failed.step] or \
                 [r for r in others if not r.finished and r.where and not r.waiting]
        if frozen:
            r = frozen[0]
            why = f"stopped answering (no telemetry for {silence(r):.0f} s: stopped or frozen) at step {r.step}, " \
                  f"last seen {r.describe_where()}"
        elif behind:
            r = behind[0]
            why = f"stopped making progress at step {r.step}, {r.describe_where()}"
        else:
            return None
        evidence = []
        for rank in [failed, *others]:
            state = "waiting in a collective" if rank.waiting else "not in a collective"
            quiet = f", no telemetry for its last {silence(rank):.0f} s" if rank in frozen else ""
            evidence.append(f"rank {rank.rank} on {rank.host}: step {rank.step}, {rank.describe_where()}, {state}{quiet}")
        return Culprit(r.rank, r.host, why, tuple(evidence))


    def behind(self) -> tuple[list[RankState], list[RankState]]:
        """(ranks holding the others up, ranks waiting for them).

        Ranks at the lowest step are behind when steps differ. When every rank is at the same step
        (a collective every step keeps them within one), the ranks whose training thread is *not*
        inside a collective are the ones the others wait for.
        """
        ranks = [r for r in self.sorted_ranks() if not r.finished]
        if not ranks:
            return [], []
        low = min(r.step for r in ranks)
        if any(r.step > low for r in ranks):
            return [r for r in ranks if r.step == low], [r for r in ranks if r.step > low]
        waiting = [r for r in ranks if r.where and r.where.get("in_collective")]
        if waiting and len(waiting) < len(ranks):
            return [r for r in ranks if r not in waiting], waiting
        return [], ranks
