"""Run one candidate for a few steps through the normal launcher, and watch it from its telemetry.

    runner = TrialRunner(setup)
    trial = runner.run(candidate, index=3, phase="sharding", stop=lambda records: None, progress=show)

A trial is `python -m zerorun.tune.guard` (the launcher, plus an end-with-the-tuner guard) with the
user's recipe and the candidate's keys as `--set` overrides, its output in `<tune dir>/tNN.log`
and its telemetry in `runs/<name>/tune-<time>/tNN/telemetry.jsonl`. While it runs, the runner
tails that file every `POLL_S`, reads the high-water mark (VmHWM) of the workers on this machine
(their pids come in the `hello` records), and ends the trial with SIGTERM, which the launcher turns
into an orderly stop of the job on every node, as soon as:
- the measurement is complete: `steps` steps after the `warmup` ones, lasting at least `min_seconds`;
- the `stop` callback gives a reason (the tuner's early stopping: slower than the best, out of time);
- no step arrives for `stall_s` (the tuner sets it from the trials so far).
A trial that fails ends by itself; its cause is read from the launcher's failure report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import zerorun
from zerorun.launch.plan import is_local
from zerorun.telemetry import RUNS_DIR
from zerorun.tune.load import LoadMeter
from zerorun.tune.measure import Status, Trial, TrialRecords, failure_cause
from zerorun.tune.space import Candidate

POLL_S = 0.2
STEPS_CAP = 1000  # train.steps of a trial beyond its warm-up: it is stopped as soon as it has measured enough
TERM_WAIT_S = 30.0  # after SIGTERM, how long the launcher may take to stop the job before it is killed
SAMPLE_INTERVAL_S = 0.5  # telemetry.interval_s of a trial: sampled RSS (remote ranks) and CUDA peaks

Stop = Callable[[TrialRecords], tuple[Status, str] | None]


@dataclass(frozen=True)
class TrialSetup:
    """What every trial of one tuning shares."""

    recipe: str  # the user's recipe file
    name: str  # the recipe's run name
    stamp: str  # this tuning's id, e.g. tune-20250105-100000: trials are runs/<name>/<stamp>/tNN
    launch_options: dict = field(default_factory=dict)  # hostfile, include, ... as for `zerorun launch`
    overrides: tuple[str, ...] = ()  # the user's own --set, applied to every trial first
    nvme_path: str | None = None
    warmup: int = 1
    steps: int = 3
    min_seconds: float = 2.0
    stall_s: float = 300.0

    @property
    def tune_dir(self) -> Path:
        """runs/<name>/<stamp>/: every trial's telemetry and log, and the tuning's results."""
        return Path(RUNS_DIR) / self.name / self.stamp


def trial_overrides(setup: TrialSetup, candidate: Candidate, index: int) -> list[str]:
    """The `--set` list of one trial: the user's, the candidate's keys, and the trial's own housekeeping."""
    sets = [*setup.overrides, *(f"{key}={_yaml(value)}" for key, value in candidate.settings().items())]
    for kind in ("offload_optimizer", "offload_param"):
        if getattr(candidate, kind) == "nvme" and setup.nvme_path:
            sets.append(f"zero.{kind}.nvme_path={setup.nvme_path}")
    trial = f"t{index:02d}"
    return [*sets, f"name={setup.name}/{setup.stamp}/{trial}", f"train.steps={setup.warmup + STEPS_CAP}",
            f"checkpoint.dir={setup.tune_dir / (trial + '-ckpt')}", "checkpoint.resume=never",
            "checkpoint.every_steps=0", "telemetry.enabled=true", f"telemetry.interval_s={SAMPLE_INTERVAL_S}"]


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


class TrialRunner:
    """Runs trials one after another (from the main thread: the guard watches its parent process)."""

    def __init__(self, setup: TrialSetup) -> None:
        self.setup = setup
        setup.tune_dir.mkdir(parents=True, exist_ok=True)

    def run(self, candidate: Candidate, index: int, phase: str, stop: Stop,
            progress: Callable[[Trial, TrialRecords], None] = lambda trial, records: None,
            stall_s: float | None = None) -> Trial:
        """Run `candidate` until it is measured, `stop` gives a reason, it fails, or no step comes for
        `stall_s` (default: the setup's) from its start or its last step."""
        s = self.setup
        trial = Trial(candidate, Status.FAILED, phase, index, log=str(s.tune_dir / f"t{index:02d}.log"),
                      run_dir=str(s.tune_dir / f"t{index:02d}"))
        telemetry = Path(trial.run_dir) / "telemetry.jsonl"
        records, tail = TrialRecords(), _Tail(telemetry)
        started, meter = time.monotonic(), LoadMeter.start()
        proc = self._start(candidate, index, trial.log)
        try:
            ended = self._watch(proc, trial, records, tail, stop, progress, stall_s or s.stall_s)
        except KeyboardInterrupt:  # Ctrl-C: the job stops (the launcher got it too, or gets SIGTERM now)
            self._stop(proc)
            raise
        code = proc.wait()
        trial.loads = [meter.stop()]
        for record in tail.read():
            records.feed(record)
        self._fill(trial, records)
        trial.wall_s, trial.ended_at = time.monotonic() - started, time.time()
        trial.status, trial.cause = ended or self._ending(records, code, trial.log)
        shutil.rmtree(s.tune_dir / f"t{index:02d}-ckpt", ignore_errors=True)
        if s.nvme_path and candidate.uses_nvme:
            _remove_nvme_files(Path(s.nvme_path), Path(s.name) / s.stamp / f"t{index:02d}")
        return trial

    def _watch(self, proc: subprocess.Popen, trial: Trial, records: TrialRecords, tail: _Tail, stop: Stop,
               progress: Callable[[Trial, TrialRecords], None], stall_s: float) -> tuple[Status, str] | None:
        """Follow the running trial; end it (and return why) once a verdict comes, or return None when it ends."""
        started = last_step = time.monotonic()
        last_count = 0
        while proc.poll() is None:
            time.sleep(POLL_S)
            for record in tail.read():
                records.feed(record)
            _read_high_water_marks(records)
            count = sum(len(r.steps) for r in records.ranks.values())
            if count > last_count:
                last_step, last_count = time.monotonic(), count
                trial.startup_s = trial.startup_s or last_step - started
            ended = self._verdict(records, stop, time.monotonic() - last_step, stall_s)
            self._fill(trial, records)
            progress(trial, records)
            if ended is not None:
                self._stop(proc)
                return ended
        return None

    def _start(self, candidate: Candidate, index: int, log: str) -> subprocess.Popen:
        spec = {"recipe": self.setup.recipe, "parent": os.getpid(),
                "options": {**self.setup.launch_options, "overrides": trial_overrides(self.setup, candidate, index)}}
        env = dict(os.environ)
        checkout = Path(zerorun.__file__).resolve().parents[1]
        if (checkout / "pyproject.toml").is_file():  # run from a source tree: trials import this same zerorun
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(checkout), env.get("PYTHONPATH")) if p)
        with open(log, "wb") as out:
            return subprocess.Popen([sys.executable, "-m", "zerorun.tune.guard", json.dumps(spec)], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def _verdict(self, records: TrialRecords, stop: Stop, quiet_s: float, stall_s: float
                 ) -> tuple[Status, str] | None:
        """Why the running trial should end now, or None to let it go on."""
        s = self.setup
        if records.measured_steps(s.warmup) >= s.steps and records.measured_seconds(s.warmup) >= s.min_seconds:
            return Status.MEASURED, ""
        if quiet_s > stall_s:
            if records.world_size is None:
                return Status.STALLED, f"no telemetry from the launcher for {quiet_s:.0f} s"
            return Status.STALLED, f"no step for {quiet_s:.0f} s"
        return stop(records)

    def _fill(self, trial: Trial, records: TrialRecords) -> None:
        w = self.setup.warmup
        trial.throughput, trial.unit = records.throughput(w), records.unit
        trial.best_step, trial.step_s = records.best_step(w), records.step_seconds(w)
        trial.steps = records.measured_steps(w)
        trial.peak_rss, trial.peak_gpu = records.peak_rss, records.peak_gpu
        trial.params, trial.samples_per_step = records.params, records.samples_per_step()

    def _ending(self, records: TrialRecords, code: int, log: str) -> tuple[Status, str]:
        """How a trial that ended by itself went: measured if it got far enough, else why it failed."""
        if code == 0 and records.measured_steps(self.setup.warmup) >= 1:
            return Status.MEASURED, ""  # the script ended first (its own step count, or its data)
        if code == 0:
            return Status.FAILED, (f"the script ended after {records.measured_steps(0)} step(s), fewer than the "
                                   f"{self.setup.warmup} warm-up step(s) plus one to measure")
        output = Path(log).read_text(errors="replace") if Path(log).is_file() else ""
        return failure_cause(output, code)

    @staticmethod
    def _stop(proc: subprocess.Popen) -> None:
        """SIGTERM: the launcher stops the job everywhere; SIGKILL only if it does not end in time."""
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(TERM_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()


class _Tail:
    """The complete lines appended to a JSONL file since the last read (the file may not exist yet)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        out = []
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


def _remove_nvme_files(root: Path, trial: Path) -> None:
    """The trial's offload files (`<nvme_path>/<run name>/rank-<r>/`), then its parents as far as they are empty."""
    shutil.rmtree(root / trial, ignore_errors=True)
    for parent in trial.parents:
        if parent != Path("."):
            try:
                (root / parent).rmdir()
            except OSError:
                break


def _read_high_water_marks(records: TrialRecords) -> None:
    """Each local worker's peak RSS so far (VmHWM): exact, where sampling every interval may miss a peak."""
    for rank in records.ranks.values():
        if rank.pid is None or not is_local(rank.host or ""):
            continue
        try:
            proc = psutil.Process(rank.pid)
            if rank.pid_start is not None and abs(proc.create_time() - rank.pid_start) > 1.0:
                continue  # the pid was reused
            rank.hwm = max(rank.hwm, _vm_hwm(rank.pid))
        except (psutil.Error, OSError):
            continue


def _vm_hwm(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
