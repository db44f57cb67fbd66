"""The supervisor: runs a launch plan, one transport per node, and decides how the job ends.

- **Output.** One reader thread per stream puts lines on a queue; the main thread prints them as
  they come (worker lines already carry their `[host:rank] ` prefix, torchrun's own lines get
  `[host:torchrun] `) and keeps each rank's last lines for the failure report.
- **First failure ends the job.** The first exit record (see `streams`) with a non-zero status
  stops every node at once. torchrun would notice too, but then signals the workers' groups and
  waits up to 30 s before SIGKILL, and it exits 1 whatever the rank's status was; the supervisor
  stops everything within `kill_grace_s` and exits with the failing rank's own status.
- **A lost node ends the job.** A node whose transport exits non-zero while others still run (its
  ssh connection dropped, the host stopped answering, torchrun failed there) stops every node once
  `_NODE_SETTLE_S` has passed without a rank's exit record explaining it.
- **Signals.** SIGINT, SIGTERM and SIGHUP to the launcher stop the job the same way; the launcher
  exits 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). The handler only records the
  signal: the main loop wakes every 0.1 s and acts, so no lock is ever taken inside a handler.
- **Nothing left behind.** Whatever the ending (success included), every transport's `stop` runs,
  which ends every process that still carries the job's id.
- **Where lines go** is an `Output`: by default straight to stdout/stderr; the telemetry monitor
  (`zerorun.telemetry.monitor`) is another, which shows them above a live table and uses the loop's
  `tick` to refresh it and to watch for stalls.
"""

from __future__ import annotations

import queue
import signal
import sys
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, BinaryIO

from zerorun.launch import streams
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.streams import RankExit, RankLine
from zerorun.launch.transport import Transport

TAIL_LINES = 20  # lines of a failed rank shown in the failure report
_SETTLE_S = 2.0  # after every torchrun exited: how long to wait for their pipes to close
_NODE_SETTLE_S = 1.0  # after one node failed while others run: how long its ranks' exit records may take
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Outcome:
    """How the job ended; `exit_code` is the launcher's."""

    exit_code: int
    failure: RankExit | None = None  # the first rank that failed
    failed_node: int | None = None  # a torchrun that failed without any rank failing
    signal: int | None = None  # the signal that stopped the launcher


class Output:
    """Where the supervisor's lines go: here, to stdout (fd 1) and stderr (fd 2) as they come."""

    def __init__(self, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> None:
        self.files = {1: stdout or sys.stdout.buffer, 2: stderr or sys.stderr.buffer}

    def write(self, fd: int, line: bytes) -> None:
        out = self.files[fd]
        try:
            out.write(line + b"\n")
            out.flush()
        except (BrokenPipeError, ValueError):
            pass  # our own output is gone (piped into `head`): keep supervising

    def tick(self) -> None:
        """Called about every 0.1 s while the job runs (and while its last output drains)."""


class Supervisor:
    """Runs `plan` through `transports` (one per node, in node order) and returns the exit code."""

    def __init__(self, plan: LaunchPlan, transports: Sequence[Transport], output: Output | None = None) -> None:
        assert len(transports) == len(plan.nodes), "supervisor: one transport per node"
        self.plan = plan
        self.transports = list(transports)
        self.output = output or Output()
        self._events: queue.Queue[tuple[int, int, bytes | None]] = queue.Queue()
        self._open_streams = [0] * len(transports)
        self._tails: dict[tuple[str, int | str], deque[bytes]] = defaultdict(lambda: deque(maxlen=TAIL_LINES))
        self._first_failure: RankExit | None = None
        self._signal: int | None = None
        self._stopping = False

    def run(self) -> int:
        previous = self._install_signal_handlers()
        try:
            self._say(f"job {self.plan.job_id}: {_plural(sum(n.node_count for n in self.plan.nodes), 'node')}, "
                      f"{_plural(self.plan.world_size, 'worker')}, master {self.plan.master_addr}:{self.plan.master_port}")
            for index, (node, transport) in enumerate(zip(self.plan.nodes, self.transports)):
                out, err = transport.start(node)
                self._read_in_background(index, 1, out)
                self._read_in_background(index, 2, err)
            outcome = self._watch()
        finally:
            self._stopping = True
            still_running = self._stop_all()
            self._drain(_SETTLE_S)
            self._restore_signal_handlers(previous)
        self._report(outcome, still_running)
        return outcome.exit_code

    # -- watching ---------------------------------------------------------------------------------

    def _watch(self) -> Outcome:
        """Handle output until the first of: a signal, a failed rank, every torchrun having exited."""
        exited_at: float | None = None
        failed_at: dict[int, float] = {}
        while True:
            if self._signal is not None:
                self._say(f"received {signal.Signals(self._signal).name}; stopping job {self.plan.job_id}")
                return Outcome(128 + self._signal, signal=self._signal)
            self._handle_events(timeout=0.1)
            self.output.tick()
            if self._first_failure is not None:
                return Outcome(self._first_failure.exit_status, failure=self._first_failure)
            for index, transport in enumerate(self.transports):
                code = transport.poll()
                if code and time.monotonic() - failed_at.setdefault(index, time.monotonic()) > _NODE_SETTLE_S:
                    self._handle_events(timeout=0)
                    if self._first_failure is not None:
                        return Outcome(self._first_failure.exit_status, failure=self._first_failure)
                    return Outcome(_status(code), failed_node=index)
            if all(t.poll() is not None for t in self.transports):
                exited_at = exited_at or time.monotonic()
                # Their exit records may still be in the pipes: read on until the pipes close.
                if sum(self._open_streams) == 0 or time.monotonic() - exited_at > _SETTLE_S:
                    self._handle_events(timeout=0)
                    return self._outcome_of_exits()

    def _outcome_of_exits(self) -> Outcome:
        """Every torchrun exited by itself: a rank's failure, else a torchrun's failure, else success."""
        if self._first_failure is not None:
            return Outcome(self._first_failure.exit_status, failure=self._first_failure)
        for index, transport in enumerate(self.transports):
            code = transport.poll()
            if code:
                return Outcome(_status(code), failed_node=index)
        return Outcome(0)

    def _handle_events(self, timeout: float) -> None:
        """Handle every queued event, waiting up to `timeout` for the first one."""
        try:
            event = self._events.get(timeout=timeout) if timeout > 0 else self._events.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*event)
            try:
                event = self._events.get_nowait()
            except queue.Empty:
                return

    def _handle(self, node_index: int, fd: int, line: bytes | None) -> None:
        if line is None:
            self._open_streams[node_index] -= 1
            return
        item = streams.parse(line)
        if isinstance(item, RankExit):
            if item.failed and self._first_failure is None and not self._stopping:
                self._first_failure = item
        elif isinstance(item, RankLine):
            self._tails[(item.host, item.rank)].append(line)
            self._write(fd, line)
        else:  # torchrun's own output; once we are stopping it only narrates the teardown we started
            host = self.plan.nodes[node_index].host
            line = streams.prefix(host, "torchrun") + line
            self._tails[(host, "torchrun")].append(line)
            if not self._stopping:
                self._write(fd, line)

    def _drain(self, timeout: float) -> None:
        """Print what the streams still hold, until they close or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while sum(self._open_streams) > 0 and time.monotonic() < deadline:
            self._handle_events(timeout=0.05)
            self.output.tick()
        self._handle_events(timeout=0)

    def _read_in_background(self, node_index: int, fd: int, stream: IO[bytes]) -> None:
        def read() -> None:
            with stream:
                for line in stream:
                    self._events.put((node_index, fd, line.rstrip(b"\n")))
            self._events.put((node_index, fd, None))

        self._open_streams[node_index] += 1
        threading.Thread(target=read, name=f"zerorun-read-{node_index}-{fd}", daemon=True).start()

    # -- ending -----------------------------------------------------------------------------------

    def _stop_all(self) -> int:
        """Stop every node at once; return how many processes were still running."""
        if not self.transports:
            return 0
        with ThreadPoolExecutor(len(self.transports)) as pool:
            return sum(pool.map(lambda t: t.stop(self.plan.kill_grace_s), self.transports))

    def _report(self, outcome: Outcome, still_running: int) -> None:
        if outcome.failure is not None:
            failure = outcome.failure
            self._failure_block(f"rank {failure.rank} on {failure.host} failed ({failure.describe()})",
                                self._tails[(failure.host, failure.rank)], f"rank {failure.rank}")
            self._say(f"job {self.plan.job_id} stopped: rank {failure.rank} on {failure.host} failed; "
                      f"exit code {outcome.exit_code}")
        elif outcome.failed_node is not None:
            host = self.plan.nodes[outcome.failed_node].host
            what = self.transports[outcome.failed_node].what
            self._failure_block(f"{what} on {host} failed (exit code {outcome.exit_code})",
                                self._tails[(host, "torchrun")], what)
            self._say(f"job {self.plan.job_id} stopped: {what} on {host} failed; exit code {outcome.exit_code}")
        elif outcome.signal is not None:
            self._say(f"job {self.plan.job_id} stopped ({still_running} processes ended); "
                      f"exit code {outcome.exit_code}")
        elif still_running:
            self._say(f"job {self.plan.job_id} finished; ended {still_running} processes it left running")

    def _failure_block(self, title: str, tail: deque[bytes], who: str) -> None:
        rule = "=" * 20
        lines = [f"{rule} {title} {rule}".encode()]
        if tail:
            lines.append(f"last {len(tail)} lines of {who}:".encode())
            lines.extend(tail)
        else:
            lines.append(f"{who} printed nothing.".encode())
        lines.append(b"=" * (len(title) + 2 * len(rule) + 2))
        for line in lines:
            self._write(2, line)

    # -- output and signals -----------------------------------------------------------------------

    def _say(self, message: str) -> None:
        self._write(2, f"zerorun: {message}".encode())

    def _write(self, fd: int, line: bytes) -> None:
        self.output.write(fd, line)

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may set handlers; an embedding caller handles its own

        def record(signum: int, _frame: object) -> None:
            if self._signal is None:
                self._signal = signum

        return {sig: signal.signal(sig, record) for sig in _HANDLED_SIGNALS}

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _status(code: int) -> int:
    """A process's exit status as a shell shows it (killed by signal N: 128+N)."""
    return code if code > 0 else 128 - code


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
