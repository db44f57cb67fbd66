"""`zerorun submit`: write an sbatch script into the run directory, submit it, follow the job to its end.

    job = submit("recipe.yaml", SubmitOptions(nodes=2, gpus_per_node=8, partition="gpu"))
    exit_code = follow(job, ask=confirm)      # its output as it grows, live telemetry, its exit code

The script, `runs/<name>/submit-<time>.sbatch`, is plain bash with `#SBATCH` lines, meant to be
read, kept and edited: `sbatch` on it submits the same job again. It runs `zerorun launch RECIPE
--launcher slurm` on the job's first node, which starts one torchrun per node with srun (see
`zerorun.launch.slurm`). The job's stdout and stderr go to `runs/<name>/slurm-<job id>.out` and its
telemetry to `runs/<name>/telemetry.jsonl`, as for a launch from a terminal; so the working
directory must be on a filesystem the nodes share, as the recipe and the script already are.
`--ntasks-per-node` is the recipe's `nproc_per_node`, else `--gpus-per-node`, else 2 (one CPU
worker per task), which is how the launcher inside the job knows how many workers to start.

Following polls every half second: new lines of the output file are copied to stdout, and on a
terminal a live table at the bottom shows the job's telemetry (read from telemetry.jsonl, for the
zerorun job id that the output announces). `scontrol show job` tells the state; once the job has
ended, its exit code is ours (128 + N when it was killed by signal N). Ctrl-C asks whether to
`scancel` the job; no leaves it running and stops following.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from zerorun import config
from zerorun.config import Recipe
from zerorun.errors import LaunchError
from zerorun.telemetry import RUNS_DIR

POLL_S = 0.5
_OUTPUT_SETTLE_S = 2.0  # after the job ended: how long its output file may still grow (shared filesystems lag)
_OUTPUT_QUIET_S = 0.3  # ... and how long without growth means it is complete
_SLURM_TIMEOUT_S = 30.0
_ACTIVE = frozenset({"UNKNOWN", "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING",
                     "SIGNALING", "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD", "STOPPED"})
_JOB_LINE = re.compile(r"^zerorun: job (\S+): ")  # the supervisor's first line names the zerorun job id


@dataclass(frozen=True)
class SubmitOptions:
    """The options of `zerorun submit` (the CLI maps its flags onto these one to one)."""

    nodes: int = 1
    gpus_per_node: int | None = None
    partition: str | None = None
    time: str | None = None  # Slurm's time limit syntax, e.g. 4:00:00
    account: str | None = None
    sbatch_args: Sequence[str] = field(default_factory=tuple)  # more `#SBATCH` lines, e.g. --mem=0
    overrides: Sequence[str] = field(default_factory=tuple)  # `--set KEY=VALUE`, passed on to the launch


@dataclass(frozen=True)
class SubmittedJob:
    job_id: str  # Slurm's
    script: Path
    output: Path  # runs/<name>/slurm-<job id>.out
    telemetry: Path  # runs/<name>/telemetry.jsonl
    telemetry_offset: int = 0  # its size at submission: the records before are older jobs'


def sbatch_script(recipe: Recipe, recipe_path: Path, options: SubmitOptions, python: str, cwd: Path,
                  output: Path, written_at: str) -> str:
    """The batch script's text: a few comments, the #SBATCH directives, `cd`, and the launch."""
    nproc = recipe.nproc_per_node or options.gpus_per_node or 2
    directives = [f"--job-name={recipe.name}", f"--nodes={options.nodes}", f"--ntasks-per-node={nproc}"]
    directives += [f"--gpus-per-node={options.gpus_per_node}"] if options.gpus_per_node else []
    directives += [f"--partition={options.partition}"] if options.partition else []
    directives += [f"--time={options.time}"] if options.time else []
    directives += [f"--account={options.account}"] if options.account else []
    directives += [f"--output={output}", *options.sbatch_args]
    launch = [python, "-m", "zerorun.cli", "launch", str(recipe_path), "--launcher", "slurm"]
    launch += [arg for override in options.overrides for arg in ("--set", override)]
    return "\n".join([
        "#!/bin/bash",
        f"# Written by `zerorun submit` on {written_at} for {recipe_path}.",
        "# Keep it, edit it, and submit it again with `sbatch <this file>`. In the job, `zerorun launch`",
        "# finds the allocation and starts one torchrun per node with srun; its output goes to --output.",
        *(f"#SBATCH {directive}" for directive in directives),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(str(cwd))}",
        f"exec {shlex.join(launch)}",
        "",
    ])


def submit(recipe_path: str | Path, options: SubmitOptions, runs_dir: str | Path = RUNS_DIR) -> SubmittedJob:
    """Validate the recipe, write the script into its run directory and submit it with sbatch."""
    if options.nodes < 1:
        raise LaunchError(f"--nodes: expected at least 1, got {options.nodes}.")
    if options.gpus_per_node is not None and options.gpus_per_node < 1:
        raise LaunchError(f"--gpus-per-node: expected at least 1, got {options.gpus_per_node}.")
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch is not on PATH: `zerorun submit` needs Slurm's client commands "
                          "(run it on a login node of the cluster).")
    recipe_path = Path(recipe_path).resolve()
    recipe = config.load(recipe_path, overrides=options.overrides)  # a bad recipe fails here, not in the queue
    run_dir = (Path.cwd() / runs_dir / (recipe.name or "job")).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    script = run_dir / f"submit-{stamp}.sbatch"
    for count in range(2, 100):
        if not script.exists():
            break
        script = run_dir / f"submit-{stamp}-{count}.sbatch"
    output = run_dir / "slurm-%j.out"
    script.write_text(sbatch_script(recipe, recipe_path, options, sys.executable, Path.cwd(), output,
                                    time.strftime("%Y-%m-%d %H:%M:%S")))
    telemetry = run_dir / "telemetry.jsonl"
    offset = telemetry.stat().st_size if telemetry.exists() else 0
    result = _slurm(["sbatch", "--parsable", str(script)])
    if result.returncode != 0:
        problem = (result.stderr.strip().splitlines() or [f"exit code {result.returncode}"])[-1]
        raise LaunchError(f"sbatch did not take {script}: {problem}")
    job_id = result.stdout.strip().split(";")[0]  # `id` or `id;cluster`
    return SubmittedJob(job_id, script, Path(str(output).replace("%j", job_id)), telemetry, offset)


# ---------------------------------------------------------------------------------------------
# Following


@dataclass(frozen=True)
class JobState:
    """What `scontrol show job` says about a job (None: slurmctld no longer knows it)."""

    state: str
    reason: str = ""
    exit_code: str = "0:0"  # Slurm's CODE:SIGNAL

    @property
    def ended(self) -> bool:
        return self.state not in _ACTIVE

    @property
    def exit_status(self) -> int:
        """What a shell would report: the code, 128 + the signal, or 1 for a job that failed without one."""
        return exit_status(self.exit_code, self.state)


def exit_status(exit_code: str, state: str) -> int:
    """`3:0` -> 3, `0:15` -> 143; a job that ended badly with `0:0` (cancelled while pending) -> 1."""
    code, _, sig = exit_code.partition(":")
    status = int(sig) + 128 if sig.isdigit() and int(sig) else (int(code) if code.isdigit() else 1)
    return 1 if status == 0 and state != "COMPLETED" else status


def parse_job(scontrol_line: str) -> JobState | None:
    """The state in one `scontrol -o show job` line."""
    fields = dict(item.split("=", 1) for item in scontrol_line.split() if "=" in item)
    if "JobState" not in fields:
        return None
    return JobState(fields["JobState"], fields.get("Reason", ""), fields.get("ExitCode", "0:0"))


def job_state(job_id: str) -> JobState | None:
    """The job's state; None once slurmctld has forgotten it (then sacct is asked)."""
    result = _slurm(["scontrol", "-o", "show", "job", job_id])
    if result.returncode == 0:
        return parse_job(result.stdout)
    if "Invalid job id" not in result.stderr:  # slurmctld busy or unreachable: ask again at the next poll
        return JobState("UNKNOWN", result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "")
    try:
        accounting = _slurm(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    except LaunchError:  # no sacct here
        return None
    for line in accounting.stdout.splitlines():
        state, _, code = line.strip().partition("|")
        if state:
            return JobState(state.split()[0], "", code)
    return None


def follow(job: SubmittedJob, ask: Callable[[str], bool], out: TextIO | None = None, live: bool | None = None,
           poll_s: float = POLL_S) -> int:
    """Copy the job's output to `out` until it ends and return its exit status; Ctrl-C asks to scancel."""
    out = out or sys.stdout
    view = _Follower(job, out, _is_terminal(out) if live is None else live)
    interrupted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: interrupted.append(signum))
    cancelled = False
    shown = None
    try:
        while True:
            view.copy_output()
            state = job_state(job.job_id)
            if state is None:
                view.say(f"job {job.job_id} has ended; slurmctld and sacct no longer know its exit code")
                return 1
            if (state.state, state.reason) != shown and not state.ended:
                shown = (state.state, state.reason)
                reason = f" ({state.reason})" if state.reason not in ("", "None") else ""
                view.say(f"Slurm job {job.job_id}: {state.state}{reason}")
            if state.ended:
                view.copy_output(settle_s=_OUTPUT_SETTLE_S)
                view.say(f"Slurm job {job.job_id} {state.state}; exit code {state.exit_status}")
                return state.exit_status
            if interrupted:
                interrupted.clear()
                view.pause()
                if cancelled:
                    view.say(f"stopped following job {job.job_id}, which was cancelled")
                    return 130
                if not ask(f"Cancel Slurm job {job.job_id} (scancel)?"):
                    view.say(f"stopped following; job {job.job_id} goes on: output in {job.output}, "
                             f"`scancel {job.job_id}` cancels it")
                    return 130
                _slurm(["scancel", job.job_id])
                cancelled = True
                view.say(f"cancelled job {job.job_id}; following it to its end (Ctrl-C again to stop following)")
            view.refresh()
            time.sleep(poll_s)
    finally:
        signal.signal(signal.SIGINT, previous)
        view.close()


class _Follower:
    """The output file's new lines, and the job's telemetry as a live table on a terminal."""

    def __init__(self, job: SubmittedJob, out: TextIO, live: bool) -> None:
        self.job = job
        self.out = out
        self.live_wanted = live
        self._output_offset = 0
        self._partial = b""
        self._telemetry_offset = job.telemetry_offset
        self._zerorun_job: str | None = None
        self._current_job: str | None = None  # the job the last `job` record started
        self._state: Any = None
        self._live: Any = None

    def copy_output(self, settle_s: float = 0.0) -> None:
        """Print the output file's new complete lines; with `settle_s` (the job has ended), read on while
        the file still grows, for at most that long, and print a last unfinished line too."""
        deadline = time.monotonic() + settle_s
        while self._read_output() and time.monotonic() < deadline:
            time.sleep(_OUTPUT_QUIET_S)
        if settle_s and self._partial:
            self._print(self._partial.decode("utf-8", "replace"))
            self._partial = b""

    def _read_output(self) -> bool:
        chunk = _read_from(self.job.output, self._output_offset)
        self._output_offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            line = raw.decode("utf-8", "replace")
            match = _JOB_LINE.match(line)
            if match and self._zerorun_job is None:
                self._zerorun_job = match.group(1)
            self._print(line)
        return bool(chunk)

    def refresh(self) -> None:
        """Ingest new telemetry records and redraw the live table (on a terminal only)."""
        if not self.live_wanted or self._zerorun_job is None:
            return
        from rich.console import Console
        from rich.live import Live

        from zerorun.telemetry import console
        from zerorun.telemetry.state import RunState

        if self._state is None:
            self._state = RunState()
        self._ingest_telemetry()
        if self._live is None:
            self._live = Live(console=Console(file=self.out, force_terminal=True), auto_refresh=False, transient=True)
            self._live.start()
        self._live.update(console.live_view(self._state), refresh=True)

    def _ingest_telemetry(self) -> None:
        chunk = _read_from(self.job.telemetry, self._telemetry_offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._telemetry_offset += len(complete)
        for raw in complete.splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(record, dict):
                continue
            if record.get("type") == "job":
                self._current_job = record.get("job_id")
            if self._current_job == self._zerorun_job:
                self._state.ingest(record, float(record.get("t") or time.time()))

    def say(self, message: str) -> None:
        self._print(f"zerorun: {message}")

    def pause(self) -> None:
        """Take the live table down (before a question); the next refresh brings it back."""
        if self._live is not None:
            self._live.stop()
            self._live = None

    def close(self) -> None:
        self.pause()

    def _print(self, line: str) -> None:
        if self._live is not None:
            self._live.console.print(line, markup=False, highlight=False, soft_wrap=True)
            return
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except (BrokenPipeError, ValueError):
            pass


def _read_from(path: Path, offset: int) -> bytes:
    """What the file holds past `offset` (nothing while it does not exist yet)."""
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read()
    except FileNotFoundError:
        return b""


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _slurm(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """A Slurm client command; its absence or a hang is a LaunchError naming it."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=_SLURM_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} is not on PATH: zerorun needs Slurm's client commands here.") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"{shlex.join(argv)} did not answer within {_SLURM_TIMEOUT_S:g} s.") from None
