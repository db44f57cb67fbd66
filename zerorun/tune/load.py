"""How busy the machine was while a trial ran: the cores other processes kept busy, and the load average.

A tuning on a shared machine measures the machine as much as the candidate: a run taken while another
job compiles can be half as fast as the same run a minute later. The tuner cannot make the machine
quiet, but it can say how loaded it was, so a figure from a busy minute is read as such.

    meter = LoadMeter.start()
    ...                                   # the trial runs (this process waits for it)
    load = meter.stop()                   # Load(cpus=2, others_cores=1.3, loadavg=3.1)

Other processes' CPU is what the whole machine used (`/proc/stat`, through psutil) less this process
and its waited-for descendants (`os.times()`: the trial's launcher, torchrun and workers are reaped
down the chain, so their CPU time is counted there). `Load.between` is the pure arithmetic.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import psutil

BUSY_SHARE = 0.25  # other processes holding more than this share of the cores: the machine is loaded


@dataclass(frozen=True)
class Reading:
    """Counters at one moment: wall seconds, the machine's busy CPU seconds, this process's and its
    reaped children's CPU seconds, and the 1-minute load average."""

    wall_s: float
    machine_busy_s: float
    own_s: float
    children_s: float
    loadavg: float


@dataclass(frozen=True)
class Load:
    """The machine's load over one run."""

    cpus: int
    others_cores: float  # cores other processes kept busy on average (0 on a quiet machine)
    loadavg: float  # the 1-minute load average at the end

    @property
    def loaded(self) -> bool:
        return self.others_cores > BUSY_SHARE * self.cpus

    @staticmethod
    def between(before: Reading, after: Reading, cpus: int) -> Load:
        wall = max(after.wall_s - before.wall_s, 1e-9)
        ours = (after.own_s - before.own_s) + (after.children_s - before.children_s)
        others = max(0.0, (after.machine_busy_s - before.machine_busy_s) - ours) / wall
        return Load(cpus, round(min(others, float(cpus)), 2), round(after.loadavg, 2))


def read() -> Reading:
    """The counters now."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    guest = getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)  # already counted in user and nice
    own = os.times()
    return Reading(time.monotonic(), sum(t) - idle - guest, own.user + own.system,
                   own.children_user + own.children_system, os.getloadavg()[0])


class LoadMeter:
    """Started before a run, stopped after it has been waited for."""

    def __init__(self, start: Reading) -> None:
        self._start = start

    @classmethod
    def start(cls) -> LoadMeter:
        return cls(read())

    def stop(self) -> Load:
        return Load.between(self._start, read(), psutil.cpu_count() or 1)


def summary(loads: list[Load]) -> str | None:
    """One line on the machine's load over a tuning's runs, or None where it stayed quiet."""
    if not loads:
        return None
    mean = sum(load.others_cores for load in loads) / len(loads)
    cpus = max(load.cpus for load in loads)
    peak = max(loads, key=lambda load: load.others_cores)
    if not any(load.loaded for load in loads):
        return None
    return (f"the machine was loaded: other processes kept {mean:.1f} of {cpus} cores busy on average during the "
            f"runs (up to {peak.others_cores:.1f}; load average up to {max(ld.loadavg for ld in loads):.1f}), so "
            "single runs vary; only ratios from interleaved runs are reported as gains.")
