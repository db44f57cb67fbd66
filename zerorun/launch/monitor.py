"""The launcher's side of telemetry, plugged into the supervisor as its `Output` and its witness.

    monitor = Monitor(launch_plan)
    launch_plan = with_env(launch_plan, {ADDRESS_ENV: monitor.start()})   # collector listening
    code = Supervisor(launch_plan, transports, output=monitor).run()      # lines + tick() every 0.1 s
    monitor.finish(code)                                                  # summary table, `end` record

Display:
- On a terminal (stdout and stderr both TTYs): a rich Live region at the bottom (progress bar and
  the per-rank table, `console.live_view`). Worker and launcher lines collected since the last
  tick print above it through the Live console, so they scroll while the table stays put.
- Otherwise (CI, a log file): lines pass through unchanged; a plain `zerorun: step ...` summary
  line goes to stderr at each tenth of the steps the script runs (`train.steps`, or the total its
  engine says; with no total known, every 30 s), and at least every 30 s while steps advance.

Stall watch: once an engine exists, when no rank has finished a step for `telemetry.stall_s`, the
monitor says which ranks are behind (the lowest step; at equal steps, the ranks not waiting inside
a collective) and sends SIGUSR1 to every rank's training process. The worker bootstrap registered
`faulthandler` for SIGUSR1, so each prints all its threads' Python stacks on stderr, which the
relay prefixes with `[host:rank]`. Only pids that a `hello` announced, on this machine, with the
same process start time and this job's id in their environment, are signalled (`verified_pid`).

The collector listens on loopback when every node is local; otherwise on the address this host's
name resolves to (the one the workers are told), falling back to every interface only when that
address is not one of this machine's. It accepts only connections that prove the job's token (a
random secret per job, `TOKEN_ENV` in the workers' environment). It repeats every `stall_s` while the stall lasts, and
stops watching once every rank has reached the script's total, where one is known.
"""

from __future__ import annotations

import io
import ipaddress
import json
import os
import secrets
import signal
import socket
import time
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import psutil
from rich.console import Console
from rich.live import Live
from rich.text import Text

from zerorun import config
from zerorun.launch import JOB_ID_ENV
from zerorun.launch.outcome import Output
from zerorun.launch.plan import LaunchPlan, is_local
from zerorun.telemetry import RUNS_DIR, console
from zerorun.telemetry.collector import Collector
from zerorun.telemetry.plots import available as plots_available
from zerorun.telemetry.state import Culprit, RankState
from zerorun.telemetry.trackers import TrackerUnavailable, open_trackers

PLAIN_EVERY_S = 30.0
LIVE_REFRESH_S = 0.25
STACK_SIGNAL = signal.SIGUSR1


class Monitor(Output):
    """Collector, display and stall watch for one job."""

    def __init__(self, plan: LaunchPlan, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None,
                 live: bool | None = None, runs_dir: str | os.PathLike = RUNS_DIR, width: int | None = None,
                 token: str | None = None, advertise: str | None = None) -> None:
        """`token`: the job's (default: a random one); `advertise`: the address the workers are told
        (default: loopback when every node is local, else this host's name)."""
        super().__init__(stdout, stderr)
        self.plan = plan
        self.telemetry = plan.telemetry
        self.path = Path(runs_dir) / plan.name / "telemetry.jsonl"
        local = all(is_local(node.host) for node in plan.nodes)
        self.token = token or secrets.token_hex(32)
        advertise = advertise or ("127.0.0.1" if local else socket.getfqdn())
        self.collector = Collector(self.path, bind_host="127.0.0.1" if local else bind_address(advertise),
                                   advertise_host=advertise, token=self.token, job_id=plan.job_id)
        self.state = self.collector.state
        self.live = _is_terminal(self.files[1], self.files[2]) if live is None else live
        self._width = width
        self._live: Live | None = None
        self._pending: list[str] = []
        self._rendered_at = 0.0
        self._plain = (0, -1, 0.0)  # (step, tenth, time) of the last plain summary line
        self._stalled_at: float | None = None
        self.address: str | None = None  # host:port the workers report to, once started
        self._warned: set[str] = set()  # files, sinks and dropped records already warned about

    def start(self) -> str:
        """Start the collector (and the live region); return the address workers report to."""
        trackers, errors = open_trackers(self.telemetry, self.path.parent, self.plan.job_id, self.plan.world_size,
                                         _recipe_of(self.plan))
        self.collector.sinks, self.collector.sink_errors = trackers, errors
        self._warn_io()  # a tracker that cannot start says so now, once
        self.address = address = self.collector.start()
        self.collector.record({"type": "job", "job_id": self.plan.job_id, "name": self.plan.name,
                               "world_size": self.plan.world_size, "steps": self.plan.steps,
                               "interval_s": self.telemetry.interval_s, "stall_s": self.telemetry.stall_s,
                               "t": time.time()})
        if self.live:
            # rich writes and flushes its file, which is all _TextStream provides (it is no full IO[str]).
            rich_console = Console(file=cast(IO[str], _TextStream(self.files[1])), force_terminal=True, width=self._width)
            self._live = Live(console=rich_console, auto_refresh=False, transient=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return address

    # -- the supervisor's Output -------------------------------------------------------------------

    def write(self, fd: int, line: bytes) -> None:
        if self._live is not None:
            self._pending.append(line.decode("utf-8", "replace"))
        else:
            super().write(fd, line)

    def tick(self) -> None:
        try:
            self._tick(time.time())
        except Exception as exc:  # noqa: BLE001 - the display must never end the job
            self._stop_live()
            super().write(2, f"zerorun: telemetry display stopped: {exc!r}".encode())

    def finish(self, exit_code: int) -> None:
        """The job has ended: record it, print the summary, close everything (never raises)."""
        try:
            self.collector.record({"type": "end", "exit_code": exit_code, "t": time.time()})
        finally:
            self.collector.close()
        self._warn_io()
        try:
            self._summarize()
            if exit_code == 0:
                self._warn_no_engine()
        except Exception as exc:  # noqa: BLE001 - the job's exit code matters more than its summary
            self._stop_live()
            super().write(2, f"zerorun: telemetry summary failed: {exc!r}".encode())

    def _warn_no_engine(self) -> None:
        """The script never built an engine (a plain DDP script): the engine's keys the user set did nothing, and the
        user hears it now rather than from the memory the job took."""
        with self.collector.lock:
            built = self.state.engine_at is not None or not self.state.ranks  # no telemetry at all: nothing to say
        unused = [f"{key} ({where})" for key, where in _given_of(self.plan).items()
                  if key.split(".")[0] in ENGINE_SECTIONS]
        if not built and unused:
            self._say(f"no rank built an engine: the script never called zerorun.initialize, so {', '.join(unused)} "
                      f"did nothing. It trained as its own code says (plain DDP, for a script that wraps its model in "
                      f"DDP), without ZeRO. To train with zerorun's stages, hand the model and optimizer to "
                      f"zerorun.initialize instead of DDP (docs/coming-from-ddp.md).")

    def _summarize(self) -> None:
        with self.collector.lock:
            ranks = bool(self.state.ranks)
            view = console.live_view(self.state)
            table = console.summary(self.state) if ranks else None
            checkpoints = console.checkpoint_line(self.state)
        if self._live is not None:
            self._flush_pending()
            self._live.update(view, refresh=True)
            self._stop_live(keep=table)
        elif table is not None:
            for line in _plain_text(table, self._width or console.SUMMARY_WIDTH).splitlines():
                super().write(2, line.rstrip().encode())
        if checkpoints is not None and self._live is None:  # the live view shows it already
            self._say(checkpoints)
        for restart in self.state.restarts:
            self._say(restart.describe())
        if ranks and self.collector.write_error is None:
            more = "".join(f", {sink.name} {sink.directory}" for sink in self.collector.sinks)
            plots = ", with plots" if plots_available() else " (plots need matplotlib: pip install 'zerorun[report]')"
            self._say(f"telemetry: {self.path} ({self.collector.records} records){more}; "
                      f"`zerorun report {self.path.parent}` shows this summary again{plots}")

    def _warn_io(self) -> None:
        """One warning per file or sink that could not be written (the job goes on, its exit code is the workers')."""
        collector = self.collector
        problems: list[tuple[str, Exception, str]] = [(str(self.path), collector.write_error, f"it stops after about {collector.written} records")] \
            if collector.write_error else []
        problems += [(name, exc, "nothing more goes there") for name, exc in collector.sink_errors]
        if collector.rejected and "records" not in self._warned:
            self._warned.add("records")
            self._say(f"warning: telemetry: dropped a record that does not match the telemetry schema "
                      f"({collector.rejected_reason}); later ones are dropped without a word")
        if collector.refused and "connections" not in self._warned:
            self._warned.add("connections")
            self._say("warning: telemetry: closed a connection that did not prove the job's token (not one of "
                      "this job's workers)")
        for what, exc, consequence in problems:
            if what not in self._warned:
                self._warned.add(what)
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
                    str(exc) if isinstance(exc, TrackerUnavailable) else repr(exc)
                self._say(f"warning: telemetry: cannot write {what} ({reason}); {consequence}; the live view and "
                          "summary go on, and the job's exit code is the workers'")

    def last_step(self) -> int | None:
        """The furthest step any rank reported (telemetry lags the workers by up to a flush interval, and
        a killed rank's last records never come: the culprit's own count may be far behind its peers')."""
        with self.collector.lock:
            return max((r.step for r in self.state.ranks.values() if r.steps_seen), default=None)

    def restarted(self, plan: LaunchPlan, attempt: int, cause: str, decision: str, failed_at: float,
                  torn_down_at: float) -> None:
        """A new attempt starts: say so in the stream (the state starts its ranks over) and watch it afresh."""
        self.plan = plan
        self.collector.job_id = plan.job_id
        self.collector.record({"type": "restart", "attempt": attempt, "job_id": plan.job_id,
                               "world_size": plan.world_size, "cause": cause, "decision": decision,
                               "failed_at": failed_at, "torn_down_at": torn_down_at, "t": time.time()})
        self._stalled_at = None
        self._plain = (0, -1, 0.0)

    def waiting(self, rank: int) -> bool:
        """The supervisor's witness: whether `rank` was last seen waiting inside a collective."""
        with self.collector.lock:
            state = self.state.ranks.get(rank)
            return state is not None and state.waiting

    def last_rss(self, rank: int) -> int | None:
        """The supervisor's witness: the rank's resident memory in its last sample."""
        with self.collector.lock:
            state = self.state.ranks.get(rank)
            return state.rss if state is not None else None

    def culprit(self, failed_rank: int) -> Culprit | None:
        """The supervisor's witness: the rank `failed_rank` was waiting for when it failed, if any."""
        with self.collector.lock:
            return self.state.culprit(failed_rank)

    # -- each tick ---------------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        self._warn_io()
        with self.collector.lock:
            stall = self._stall_check(now)
            view = None
            if self._live is not None and (self._pending or stall or now - self._rendered_at >= LIVE_REFRESH_S):
                view = console.live_view(self.state, now)
            plain = self._plain_line(now) if self._live is None else None
        if stall is not None:
            self._report_stall(*stall)
        if plain is not None:
            super().write(2, f"zerorun: {plain}".encode())
        if view is not None and self._live is not None:
            self._flush_pending()
            self._live.update(view, refresh=True)
            self._rendered_at = now

    def _plain_line(self, now: float) -> str | None:
        step, total = self.state.step, self.state.total_steps
        last_step, last_tenth, last_at = self._plain
        if step == 0 or step == last_step:
            return None
        tenth = step * 10 // total if total else -1
        if tenth == last_tenth and now - last_at < PLAIN_EVERY_S:
            return None
        self._plain = (step, tenth, now)
        return console.summary_line(self.state, now)

    def _stall_check(self, now: float) -> tuple[list[str], list[RankState], dict[str, Any]] | None:
        """Under the lock: the stall report's lines, the ranks to signal and the record, when due."""
        state = self.state
        since = state.last_step_at or state.engine_at
        ranks = [r for r in state.sorted_ranks() if not r.finished]
        if since is None or not ranks or now - since < self.telemetry.stall_s:
            return None
        if state.total_steps and state.step >= state.total_steps:
            return None  # training is over; the script may save or evaluate for as long as it likes
        if self._stalled_at is not None and now - self._stalled_at < self.telemetry.stall_s:
            return None
        self._stalled_at = now
        behind, waiting = state.behind()
        lines = [f"stall: no rank has finished a step for {now - since:.0f} s "
                 f"(telemetry.stall_s = {self.telemetry.stall_s:g}); steps: "
                 + ", ".join(f"rank {r.rank} {r.step}" for r in ranks)]
        if behind:
            lines.append("behind: " + "; ".join(_rank_spot(r) for r in behind))
        if waiting:
            label = "waiting for them: " if behind else "all ranks: "
            lines.append(label + "; ".join(_rank_spot(r) for r in waiting))
        lines.append(f"every rank's Python stack follows ({STACK_SIGNAL.name} to each worker; faulthandler)")
        record = {"type": "stall", "t": now, "quiet_s": now - since, "steps": {str(r.rank): r.step for r in ranks},
                  "behind": [r.rank for r in behind]}
        return lines, ranks, record

    def _report_stall(self, lines: list[str], ranks: list[RankState], record: dict[str, Any]) -> None:
        for line in lines:
            self._say(line)
        self.collector.record(record)
        for r in ranks:
            problem = _signal_stack(r, self.plan.job_id)
            if problem:
                self._say(f"rank {r.rank} on {r.host}: no stack: {problem}")

    # -- output helpers --------------------------------------------------------------------------

    def _say(self, message: str) -> None:
        self.write(2, f"zerorun: {message}".encode())

    def _flush_pending(self) -> None:
        if self._live is not None and self._pending:
            lines, self._pending = self._pending, []
            self._live.console.print(Text("\n".join(lines)), soft_wrap=True, highlight=False, markup=False)

    def _stop_live(self, keep: Any = None) -> None:
        live, self._live = self._live, None
        if live is None:
            return
        try:
            live.stop()  # the last view stays on screen
            if keep is not None:
                live.console.print(keep)
        finally:
            for line in self._pending:  # anything that never made it above the table
                super().write(1, line.encode())
            self._pending = []


def _rank_spot(r: RankState) -> str:
    return f"rank {r.rank} on {r.host} at step {r.step}, {r.describe_where()}"


def _signal_stack(r: RankState, job_id: str) -> str | None:
    """Ask one rank's training process for its stacks; a reason when it cannot be asked."""
    if r.pid is None or r.pid_start is None:
        return "it never said hello"
    if not is_local(r.host):
        return "on another machine (stacks come from this machine's workers only)"
    try:
        problem = verified_pid(r.pid, r.pid_start, job_id)
        if problem:
            return problem
        psutil.Process(r.pid).send_signal(STACK_SIGNAL)
    except psutil.NoSuchProcess:
        return f"pid {r.pid} has exited"
    except psutil.Error as exc:
        return str(exc)
    return None


def verified_pid(pid: int, pid_start: float, job_id: str) -> str:
    """Why `pid` must not be signalled as this job's worker ('' when it may): it must have started when its
    `hello` said, and carry this job's id in its environment (which only the job's own processes do)."""
    proc = psutil.Process(pid)
    if abs(proc.create_time() - pid_start) > 1.0:
        return f"pid {pid} is a different process now"
    try:
        env = proc.environ()
    except psutil.AccessDenied:
        return f"pid {pid}: its environment cannot be read, so it cannot be shown to be this job's"
    if env.get(JOB_ID_ENV) != job_id:
        return f"pid {pid} is not a process of job {job_id}"
    return ""


def bind_address(host: str) -> str:
    """The address the collector listens on for workers told `host`: that address when it is this
    machine's, else every interface ('')."""
    try:
        address = str(socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0])
        if ipaddress.ip_address(address.split("%")[0]).is_loopback:  # 127.0.1.1 of /etc/hosts: not what others reach
            return ""
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            probe.bind((address, 0))
    except (OSError, IndexError, ValueError):
        return ""
    return str(address)


def _is_terminal(*streams: Any) -> bool:
    if os.environ.get("TERM") == "dumb":
        return False
    try:
        return all(stream.isatty() for stream in streams)
    except (AttributeError, ValueError):
        return False


def _plain_text(renderable: Any, width: int) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(renderable)
    return buffer.getvalue()


class _TextStream:
    """A text face on the binary stream the supervisor writes to (rich writes str)."""

    encoding = "utf-8"

    def __init__(self, raw: BinaryIO) -> None:
        self.raw = raw

    def write(self, text: str) -> int:
        try:
            self.raw.write(text.encode("utf-8", "replace"))
        except (BrokenPipeError, ValueError):
            pass
        return len(text)

    def flush(self) -> None:
        try:
            self.raw.flush()
        except (BrokenPipeError, ValueError):
            pass

    def isatty(self) -> bool:
        return True


ENGINE_SECTIONS = ("zero", "precision", "optimizer", "scheduler", "train", "checkpoint")  # read by the engine alone


def _given_of(plan: LaunchPlan) -> dict[str, str]:
    """The recipe keys the user set, and where (`Recipe.given`), as the workers get them."""
    blob = plan.nodes[0].env.get(config.RECIPE_ENV) if plan.nodes else None
    given = json.loads(blob).get(config.GIVEN_KEY) if blob else None
    return dict(given or {})


def _recipe_of(plan: LaunchPlan) -> dict[str, Any] | None:
    """The resolved recipe the workers get (the trackers' run config), from the first node's environment."""
    blob = plan.nodes[0].env.get(config.RECIPE_ENV) if plan.nodes else None
    data = json.loads(blob) if blob else None
    if data is not None:
        data.pop(config.GIVEN_KEY, None)  # where each key was set: for the workers' messages, not a run's config
    return data
