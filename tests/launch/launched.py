"""Run `zerorun launch` as a real subprocess and watch it, for the lifecycle tests.

    job = LaunchedJob.start(recipe_path)
    job.wait_for("ready", count=2)        # lines of output, as they arrive
    job.send(signal.SIGINT)
    assert job.wait() == 130 and job.seconds_since("signal") < 10
    assert job.leftovers() == []          # nothing of this job is still running

`leftovers()` checks for real: every live process whose environment carries the job's
ZERORUN_JOB_ID, plus every pid the workers printed as `pid N` that is still alive. `cleanup()`
(the fixture calls it) kills whatever a failed test left behind, by the same two criteria.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
_JOB_LINE = re.compile(r"^zerorun: job (\S+): ")
_PID_LINE = re.compile(r"^\[[^\]]+\] pid (\d+)$")


class LaunchedJob:
    """A launcher process and everything it printed so far (stdout and stderr kept apart)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._changed = threading.Condition()
        self._times: dict[str, float] = {}  # first arrival of each stdout line, "signal", "exit"
        self._exit_wall_time = float("inf")
        self._readers = [threading.Thread(target=self._read, args=(proc.stdout, self.stdout), daemon=True),
                         threading.Thread(target=self._read, args=(proc.stderr, self.stderr), daemon=True)]
        for reader in self._readers:
            reader.start()

    @classmethod
    def start(cls, recipe: Path, *flags: str, cwd: Path | None = None, prefix: Sequence[str] = ()) -> LaunchedJob:
        """Launch `recipe` from `cwd` (where runs/<name>/telemetry.jsonl goes; default: the checkout), run
        through `prefix` (e.g. on an emulated cluster's node)."""
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "zerorun.cli", "launch", str(recipe), *flags],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(),
                                cwd=cwd or REPO)
        return cls(proc)

    def _read(self, stream, sink: list[str]) -> None:
        for line in stream:
            with self._changed:
                sink.append(line.rstrip("\n"))
                if sink is self.stdout:
                    self._times.setdefault(sink[-1], time.monotonic())
                self._changed.notify_all()

    # -- watching ---------------------------------------------------------------------------------

    def wait_for(self, text: str, count: int = 1, timeout: float = 60.0, stream: str = "stdout") -> None:
        """Wait until `count` lines of `stream` (stdout or stderr) end with `text`; else fail with the output."""
        lines = self.stdout if stream == "stdout" else self.stderr
        with self._changed:
            done = self._changed.wait_for(
                lambda: sum(line.endswith(text) for line in lines) >= count or self.proc.poll() is not None,
                timeout=timeout)
        assert done and self.proc.poll() is None, f"launcher ended or timed out before {count}x {text!r}:\n{self.output}"

    def wait_until(self, condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
        """Wait until `condition()` (checked whenever a line arrives) holds while the launcher runs."""
        with self._changed:
            done = self._changed.wait_for(lambda: condition() or self.proc.poll() is not None, timeout=timeout)
        assert done and self.proc.poll() is None, f"launcher ended or timed out before {what}:\n{self.output}"

    def send(self, sig: int) -> None:
        self._times["signal"] = time.monotonic()
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 90.0) -> int:
        """The launcher's exit code; its output is complete afterwards."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launcher still running after {timeout} s:\n{self.output}") from None
        self._times.setdefault("exit", time.monotonic())
        self._exit_wall_time = time.time()
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def time_of(self, event: str) -> float:
        """When `event` (a stdout line, "signal" or "exit") first happened, on `time.monotonic`'s clock."""
        assert event in self._times, f"never saw {event!r}:\n{self.output}"
        return self._times[event]

    def seconds_since(self, event: str) -> float:
        """Seconds from `event` (the stdout line, or "signal") until the launcher exited."""
        assert event in self._times and "exit" in self._times, f"never saw {event!r}:\n{self.output}"
        return self._times["exit"] - self._times[event]

    @property
    def output(self) -> str:
        return "--- stdout\n" + "\n".join(self.stdout) + "\n--- stderr\n" + "\n".join(self.stderr)

    @property
    def job_id(self) -> str | None:
        for line in list(self.stderr):
            match = _JOB_LINE.match(line)
            if match:
                return match.group(1)
        return None

    @property
    def job_ids(self) -> set[str]:
        """Every job id the launcher announced (one per attempt of a restarted job)."""
        return {m.group(1) for m in map(_JOB_LINE.match, list(self.stderr)) if m}

    def worker_pids(self) -> list[int]:
        """The pids the test scripts printed as `pid N` (workers and their children)."""
        return [int(m.group(1)) for m in map(_PID_LINE.match, list(self.stdout)) if m]

    def relay(self, rank: int) -> psutil.Process:
        """The process torchrun started for `rank`, the rank's output relay (whether it forked the rank itself or
        the node's zygote did: `zerorun.launch.warm`)."""
        def worker(proc: psutil.Process) -> bool:  # `python [-u] -m zerorun.launch.worker ...`: a relay, or its rank
            command = proc.cmdline()
            return "-m" in command and command[command.index("-m") + 1:][:1] == ["zerorun.launch.worker"]

        for proc in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if worker(proc) and not worker(proc.parent()) and proc.environ().get("RANK") == str(rank):
                    return proc
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no relay of rank {rank} among the launcher's descendants")

    # -- what is left -----------------------------------------------------------------------------

    def leftovers(self) -> list[psutil.Process]:
        """Live (non-zombie) processes of this job: by job id in their environment, or by printed pid."""
        found: dict[int, psutil.Process] = {}
        job_ids = self.job_ids  # a restarted job runs each attempt under its own id
        if job_ids:
            for proc in psutil.process_iter(["environ"], ad_value=None):
                if (proc.info.get("environ") or {}).get("ZERORUN_JOB_ID") in job_ids:
                    found[proc.pid] = proc
        for pid in self.worker_pids():
            try:
                proc = psutil.Process(pid)
                if proc.create_time() <= self._exit_wall_time:  # not a newer process that reused the pid
                    found[pid] = proc
            except psutil.NoSuchProcess:
                pass
        return [p for p in found.values() if _alive(p)]

    def cleanup(self) -> None:
        """Kill the launcher and anything of its job still alive (after a failed test)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for proc in self.leftovers():
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


def subprocess_env() -> dict[str, str]:
    """This environment, with this checkout importable (zerorun need not be installed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("ZERORUN_JOB_ID", None)
    return env


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def write_recipe(directory: Path, script: str, args: Sequence[str] = (), **keys: object) -> Path:
    """`directory`/recipe.yaml running tests/launch/scripts/<script>, with a short kill grace."""
    import yaml

    data = {"script": str(SCRIPTS / script), "args": list(args), "launch": {"kill_grace_s": 1.0}, **keys}
    path = directory / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path



BIG_RECIPE_ENV = {f"ZR_PAD_{i}": "x" * 1000 for i in range(150)}  # 150 KiB of recipe: one variable holds 128 KiB


def recipe_files_shown(job: LaunchedJob, ranks: int) -> str:
    """Check what scripts/show_recipe.py printed on each of `ranks` workers for a recipe of BIG_RECIPE_ENV:
    the whole recipe, none of it in the environment, a 0600 file in a 0700 directory. Returns the file."""
    shown = [line for line in job.stdout if "env keys" in line]
    expected = f"env keys {len(BIG_RECIPE_ENV)} in env False modes 600 700 at "
    assert len(shown) == ranks and all(expected in line for line in shown), job.output
    return shown[0].rsplit(" at ", 1)[1]
