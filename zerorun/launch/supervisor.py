"""The supervisor: runs a launch plan, one transport per node, and decides how the job ends and why.

- **Starting** a large job: at most `START_CONCURRENCY` nodes connect at once (an ssh handshake
  each, then the node supervisor's first heartbeat); a signal, a failed or a lost node stops the
  starting, and the job ends as it would have once running.
- **Output.** One reader thread for every node's streams (`node_output.OutputReader`) puts lines
  on a queue (and notes that the node was heard from); the main thread prints them as they come (worker lines already carry their
  `[host:rank] ` prefix, torchrun's own lines get `[host:torchrun] `, node supervisor notes
  `zerorun: `) and keeps each rank's last lines for the failure report. A worker's `zerorun:
  error:` line (a ZerorunError: every rank usually raises the same) is printed once per job.
  Tracebacks, and torchrun's output once a rank failed, are held back (`held_output`) until the
  job's end says whose is the cause.
- **The culprit first.** A failed job's report starts with the culprit's line and its whole
  traceback; each victim then gets one line (its exception), and everything held goes to
  `runs/<name>/failure-<job id>.log` (`failure_log`), torchrun's own report included.
- **First failure ends the job.** The first exit record (see `streams`) with a non-zero status
  stops every node. torchrun would notice too, but then signals the workers' groups and waits up
  to 30 s before SIGKILL, and it exits 1 whatever the rank's status was; the supervisor stops
  everything within `kill_grace_s` and exits with the failing rank's own status.
- **Blame the cause, not the victim.** A rank that fails because a peer stopped answering (a
  collective timeout, a closed connection) is a victim. Unless the first record is a clear cause
  (killed by a signal, or an exit code the script chose), the supervisor gives the others' exit
  records `_VICTIM_SETTLE_S` and names the likeliest cause (`_suspicion`); it checks that no other
  node has gone silent (`_LINK_SILENT_S`: they beat every second)
  and asks the `witness` (the telemetry monitor) whether another rank was holding everyone up; the
  report and the final line name the root cause (rank and host, or the node's link) with that
  evidence.
- **A lost node ends the job.** A node whose transport exits non-zero while others still run, or
  that has sent no heartbeat for `HEARTBEAT_TIMEOUT_S` (a half-open link), stops every node; the
  report says "lost contact with HOST" or "ssh to HOST closed", and never blames a rank elsewhere.
- **Signals.** SIGINT, SIGTERM and SIGHUP to the launcher stop the job the same way; the launcher
  exits 128 + the signal number (130 for Ctrl-C, 143 for SIGTERM). Another signal while the job
  is being torn down (a second Ctrl-C) kills every node's processes at once. The handler only
  records the signal: the main loop wakes every 0.1 s and acts, so no lock is taken inside it.
- **Nothing left behind.** Whatever the ending (success included), every transport's `stop` runs;
  each node's supervisor ends every process that carries the job's id and removes the node's
  NVMe offload files, even if this launcher dies meanwhile.
- **Where lines go** is an `Output`: by default straight to stdout/stderr; the telemetry monitor
  (`zerorun.launch.monitor`) is another, which shows them above a live table and uses the loop's
  `tick` to refresh it and to watch for stalls.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import threading
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from zerorun.launch import streams
from zerorun.launch.failure_report import ERROR_PREFIX, FailureReport
from zerorun.launch.held_output import HeldOutput
from zerorun.launch.node import HEARTBEAT_TIMEOUT_S
from zerorun.launch.node_output import OutputReader
from zerorun.launch.outcome import Ending, Outcome, Output, Witness
from zerorun.launch.plan import LaunchPlan
from zerorun.launch.streams import NodeBeat, NodeNote, RankExit, RankLine
from zerorun.launch.transport import Transport, exit_status

TAIL_LINES = 20  # lines of a failed rank shown in the failure report (when it printed no traceback)
_SETTLE_S = 2.0  # after every node exited: how long to wait for their pipes to close
_NODE_SETTLE_S = 1.0  # after a node exited with an error: how long its ranks' exit records may take
_VICTIM_SETTLE_S = 2.0  # after an exception (maybe a victim's): how long a peer's exit record may take
_TEARDOWN_SETTLE_S = 10.0  # after a SIGTERM torchrun sent: how long its node may take to exit (and say who failed)
_LINK_SILENT_S = 3.0  # at a rank's failure: a node silent this long (it beats every second) lost its link
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_CONCURRENCY = 64  # nodes waited for at once while stopping (every node is asked first, all at once)
START_CONCURRENCY = 64  # nodes connecting at once (started, not heard from yet: ssh's handshake, the node's start)


class Supervisor:
    """Runs `plan` through `transports` (one per node, in node order) and returns the exit code."""

    def __init__(self, plan: LaunchPlan, transports: Sequence[Transport], output: Output | None = None,
                 witness: Witness | None = None, failure_log: Path | None = None) -> None:
        assert len(transports) == len(plan.nodes), "supervisor: one transport per node"
        self.plan = plan
        self.transports = list(transports)
        self.output = output or Output()
        self.witness = witness
        self.failure_log = failure_log  # where a failed job's held output goes (None: nowhere)
        self.outcome: Outcome | None = None
        self._held = HeldOutput()
        self._events: queue.Queue[tuple[int, int, bytes | None]] = queue.Queue()
        self._open_streams = [0] * len(transports)
        self._tails: dict[tuple[str, int | str], deque[bytes]] = defaultdict(lambda: deque(maxlen=TAIL_LINES))
        self._failures: list[RankExit] = []  # every rank that failed before the stop, in arrival order
        self._torchrun_exits: dict[tuple[str, int], RankExit] = {}  # what torchrun said of failed ranks
        self._errors_shown: set[bytes] = set()
        self._repeating: set[tuple[str, int]] = set()  # ranks in the middle of repeating an error shown already
        self._signals: list[int] = []
        self._stopping = False
        self._reader: OutputReader | None = None
        self._heard_from: set[int] = set()  # nodes that sent anything since they started

    def run(self) -> int:
        previous = self._install_signal_handlers()
        self._reader = OutputReader(self._events, self._heard)
        try:
            self._say(f"job {self.plan.job_id}: {_plural(sum(n.node_count for n in self.plan.nodes), 'node')}, "
                      f"{_plural(self.plan.world_size, 'worker')}, master {self.plan.master_addr}:{self.plan.master_port}")
            self._start_all()
            outcome = dataclasses.replace(self._watch(), detected_at=time.time())
        finally:
            self._stopping = True
            self._stop_all()
            self._drain(_SETTLE_S)
            self._reader.close()
            self._restore_signal_handlers(previous)
        self.outcome = outcome
        self._report(outcome)
        return outcome.exit_code

    def _start_all(self) -> None:
        """Start the nodes in order, at most `START_CONCURRENCY` of them connecting at a time; stop
        starting at a signal, a failure or a lost node (`_watch` then decides how the job ended)."""
        started: list[int] = []
        for index, (node, transport) in enumerate(zip(self.plan.nodes, self.transports)):
            while self._connecting(started) >= START_CONCURRENCY and not self._start_interrupted(started):
                self._handle_events(timeout=0.05)
                self.output.tick()
            if self._start_interrupted(started):
                return
            out, err = transport.start(node)
            self._read_in_background(index, 1, out)
            self._read_in_background(index, 2, err)
            started.append(index)

    def _connecting(self, started: list[int]) -> int:
        """Started nodes that beat but have not been heard from yet, and still run."""
        return sum(1 for i in started if self.transports[i].heartbeats and i not in self._heard_from
                   and self.transports[i].poll() is None)

    def _start_interrupted(self, started: list[int]) -> bool:
        return bool(self._signals or self._failures or any(self.transports[i].poll() for i in started)
                    or self._lost_node(HEARTBEAT_TIMEOUT_S) is not None)

    # -- watching ---------------------------------------------------------------------------------

    def _watch(self) -> Outcome:
        """Handle output until the first of: a signal, a failure, a lost node, every node having exited."""
        exited_at: float | None = None
        first_seen: dict[int, float] = {}  # node index -> when its exit was noticed
        while True:
            if self._signals:
                sig = self._signals[0]
                self._say(f"received {signal.Signals(sig).name}; stopping job {self.plan.job_id}")
                return Outcome(128 + sig, Ending.SIGNAL, f"stopped by {signal.Signals(sig).name}", signal=sig)
            self._handle_events(timeout=0.1)
            self.output.tick()
            now = time.monotonic()
            lost = self._lost_node(HEARTBEAT_TIMEOUT_S)
            if lost is not None:
                return lost
            if self._failures or self._torchrun_exits:
                if self._settled(first_seen.setdefault(-1, now), now):
                    return self._outcome_of_failure()
            else:  # no failure: a traceback held this long was caught, and the script went on
                self._write_all(self._held.release_stale())
            for index, transport in enumerate(self.transports):
                code = transport.poll()
                if code and now - first_seen.setdefault(index, now) > _NODE_SETTLE_S:
                    self._drain_node(index)
                    failed = self._failures or self._torchrun_exits
                    return self._outcome_of_failure() if failed else self._node_outcome(index)
            if all(t.poll() is not None for t in self.transports):
                exited_at = exited_at or now
                # Their exit records may still be in the pipes: read on until the pipes close.
                if sum(self._open_streams) == 0 or now - exited_at > _SETTLE_S:
                    self._handle_events(timeout=0)
                    return self._outcome_of_exits()

    def _lost_node(self, silent_s: float) -> Outcome | None:
        """A node whose link is gone: its client says so, or it has not been heard from for `silent_s`."""
        for index, transport in enumerate(self.transports):
            cause = transport.lost_link(silent_s)
            if cause is not None:
                code = transport.poll()
                return Outcome(1 if code is None else exit_status(code), Ending.NODE_LOST, cause, host=transport.host,
                               node=index)
        return None

    def _outcome_of_failure(self) -> Outcome:
        """The first failed rank, unless a lost link or a stalled rank made it fail."""
        failure = self._root_failure()
        status = failure.exit_status
        for index, transport in enumerate(self.transports):
            lost = transport.lost_link(_LINK_SILENT_S) if transport.host != failure.host else None
            if lost is not None:  # (the failure's own exit record came over its host's link: that one works)
                return Outcome(status, Ending.NODE_LOST, lost, host=transport.host, failure=failure, node=index)
        # only a rank that may be a victim (an exception, not a signal or an exit code it chose) points elsewhere:
        # a rank SIGKILLed while its last telemetry said "waiting" is still the cause, not the peer it waited for
        victim = self._suspicion(failure) >= 2
        culprit = self.witness.culprit(failure.rank) if self.witness is not None and victim else None
        if culprit is not None and culprit.rank != failure.rank:
            cause = (f"rank {culprit.rank} on {culprit.host} {culprit.why}; rank {failure.rank} on {failure.host} "
                     f"failed waiting for it ({failure.describe()})")
            return Outcome(status, Ending.RANK_FAILED, cause, culprit.host, culprit.rank, tuple(culprit.evidence),
                           failure)
        cause = f"rank {failure.rank} on {failure.host} failed ({failure.describe()}{self._memory_of(failure)})"
        return Outcome(status, Ending.RANK_FAILED, cause, failure.host, failure.rank, failure=failure)

    def _memory_of(self, failure: RankExit) -> str:
        """For an out-of-memory kill: the rank's last resident memory, as telemetry saw it."""
        rss = self.witness.last_rss(failure.rank) if failure.oom and self.witness is not None else None
        return f"; its last RSS was {rss / 2**30:.2f} GiB" if rss else ""

    def _root_failure(self) -> RankExit:
        """The failure most likely to be the cause: see `_suspicion`; the earliest among equals.

        A rank with no exit record of its own (its relay was SIGKILLed with it) counts with what
        torchrun said of it, after the ranks that reported themselves."""
        reported = {(f.host, f.rank) for f in self._failures}
        silent = [f for key, f in self._torchrun_exits.items() if key not in reported]
        return min([*self._failures, *silent], key=self._suspicion)  # min is stable: arrival order within a kind

    def _suspicion(self, failure: RankExit) -> int:
        """0: killed by a signal (SIGKILL by the OOM killer, SIGSEGV...): never a victim. 1: an exit code
        other than 1 (the script chose it). 2: an exception while not waiting in a collective. 3: an
        exception while waiting in one (a peer vanished: a victim). 4: SIGTERM, which torchrun sends
        the other workers of its node once one failed (and the teardown sends everyone)."""
        if failure.signal is not None:
            return 4 if failure.signal == signal.SIGTERM else 0
        if failure.code != 1:
            return 1
        return 3 if self._waiting(failure.rank) else 2

    def _settled(self, since: float, now: float) -> bool:
        """Whether the failures so far can be judged: the likeliest is a clear cause, or its peers' exit
        records (a SIGKILLed rank's may come seconds after its peer's exception) had their time.

        A SIGTERM is torchrun's teardown after another rank of its node failed: that rank's record (or,
        when its relay was killed too, torchrun's line about it) comes before the node exits, however
        loaded the machine, so the judgement waits for the node (for at most `_TEARDOWN_SETTLE_S`)."""
        root = self._root_failure()
        suspicion = self._suspicion(root)
        if suspicion <= 1 or self.plan.world_size == 1:
            return True
        if suspicion == 4:
            node = self._node_of(root)
            done = node is None or (self.transports[node].poll() is not None and self._open_streams[node] == 0)
            return done or now - since > _TEARDOWN_SETTLE_S
        return now - since > _VICTIM_SETTLE_S

    def _node_of(self, failure: RankExit) -> int | None:
        return next((i for i, n in enumerate(self.plan.nodes) if n.host == failure.host and failure.rank in n.ranks),
                    None)

    def _drain_node(self, index: int) -> None:
        """Handle what node `index` still has in its pipes (it exited): for up to `_SETTLE_S`."""
        deadline = time.monotonic() + _SETTLE_S
        while self._open_streams[index] > 0 and time.monotonic() < deadline:
            self._handle_events(timeout=0.05)
        self._handle_events(timeout=0)

    def _waiting(self, rank: int) -> bool:
        return self.witness is not None and self.witness.waiting(rank)

    def _node_outcome(self, index: int) -> Outcome:
        transport = self.transports[index]
        code = transport.poll()
        assert code is not None
        lost = transport.lost_link(HEARTBEAT_TIMEOUT_S)
        ending = Ending.NODE_FAILED if lost is None else Ending.NODE_LOST
        return Outcome(exit_status(code), ending, lost or transport.describe_exit(code), host=transport.host,
                       node=index)

    def _outcome_of_exits(self) -> Outcome:
        """Every node exited by itself: a rank's failure, else a node's failure, else success."""
        if self._failures or self._torchrun_exits:
            return self._outcome_of_failure()
        for index, transport in enumerate(self.transports):
            if transport.poll():
                return self._node_outcome(index)
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
        host = self.plan.nodes[node_index].host
        if isinstance(item, NodeBeat):
            return
        if isinstance(item, NodeNote):
            self._tails[(host, "torchrun")].append(item.text.encode())
            self._say(item.text)
        elif isinstance(item, RankExit):
            if item.failed and not self._stopping:
                self._failures.append(item)
            elif not item.failed:  # a traceback it printed and survived
                self._write_all(self._held.release((item.host, item.rank)))
        elif isinstance(item, RankLine):
            self._tails[(item.host, item.rank)].append(line)
            if not self._repeated_error(item) and not self._held.take((item.host, item.rank), fd, line):
                self._write(fd, line)
        else:  # torchrun's own output; once we are stopping it only narrates the teardown we started
            self._note_torchrun_exit(node_index, line)
            line = streams.prefix(host, "torchrun") + line
            self._tails[(host, "torchrun")].append(line)
            # its report, and the teardown narration that starts it, go to the failure log
            failing = bool(self._failures or self._torchrun_exits) or streams.torchrun_tearing_down(line)
            if self._stopping and not failing:
                return  # it narrates the teardown we started
            if not self._held.take((host, "torchrun"), fd, line, hold=failing):
                self._write(fd, line)

    def _note_torchrun_exit(self, node_index: int, line: bytes) -> None:
        node = self.plan.nodes[node_index]
        if self._stopping or node.step_nodes:  # a Slurm step's lines do not say which node they come from
            return
        failure = streams.torchrun_exit(line, node.host, node.first_rank)
        if failure is not None and failure.failed:
            self._torchrun_exits.setdefault((failure.host, failure.rank), failure)

    def _repeated_error(self, item: RankLine) -> bool:
        """Whether this is a `zerorun: error:` line another rank already printed, or an indented line that continues
        one (the worker indents the further lines of a message)."""
        text = item.line.split(b"] ", 1)[-1]
        source = (item.host, item.rank)
        if text.startswith(b"  ") and source in self._repeating:
            return True
        self._repeating.discard(source)
        if not text.startswith(ERROR_PREFIX):
            return False
        seen = text in self._errors_shown
        self._errors_shown.add(text)
        if seen:
            self._repeating.add(source)
        return seen

    def _drain(self, timeout: float) -> None:
        """Print what the streams still hold, until they close or `timeout` passes."""
        deadline = time.monotonic() + timeout
        while sum(self._open_streams) > 0 and time.monotonic() < deadline:
            self._handle_events(timeout=0.05)
            self.output.tick()
        self._handle_events(timeout=0)

    def _read_in_background(self, node_index: int, fd: int, stream: IO[bytes]) -> None:
        assert self._reader is not None
        self._open_streams[node_index] += 1
        self._reader.add(node_index, fd, stream)

    def _heard(self, node_index: int) -> None:
        """The reader thread got bytes from the node (set there, not in the main loop: it may be busy stopping)."""
        self.transports[node_index].last_heard = time.monotonic()
        self._heard_from.add(node_index)

    # -- ending -----------------------------------------------------------------------------------

    def _stop_all(self) -> None:
        """Stop every node at once (each is asked, then waited for `STOP_CONCURRENCY` at a time); a signal
        meanwhile makes every node kill at once."""
        if not self.transports:
            return
        signals_before = len(self._signals)
        for transport in self.transports:
            transport.request_stop()
        with ThreadPoolExecutor(min(len(self.transports), STOP_CONCURRENCY)) as pool:
            futures = [pool.submit(t.stop, self.plan.kill_grace_s) for t in self.transports]
            hurried = False
            while not all(f.done() for f in futures):
                if len(self._signals) > signals_before and not hurried:
                    hurried = True
                    self._say(f"received {signal.Signals(self._signals[-1]).name} again; killing job "
                              f"{self.plan.job_id} now")
                    for transport in self.transports:
                        transport.hurry()
                self._handle_events(timeout=0.05)
                self.output.tick()

    def _report(self, outcome: Outcome) -> None:
        recipe = self.plan.inputs.recipe if self.plan.inputs is not None else None
        local_rank_arg = recipe is not None and recipe.launch.deepspeed_compat and recipe.launch.deepspeed_local_rank
        FailureReport(self.plan.job_id, self.output, self._held, self._tails, self.failure_log,
                      local_rank_arg).report(outcome, [*self._failures, *self._torchrun_exits.values()])

    # -- output and signals -----------------------------------------------------------------------

    def _say(self, message: str) -> None:
        self._write(2, f"zerorun: {message}".encode())

    def _write(self, fd: int, line: bytes) -> None:
        self.output.write(fd, line)

    def _write_all(self, lines: list[tuple[int, bytes]]) -> None:
        for fd, line in lines:
            self._write(fd, line)

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may set handlers; an embedding caller handles its own

        def record(signum: int, _frame: object) -> None:
            self._signals.append(signum)

        return {sig: signal.signal(sig, record) for sig in _HANDLED_SIGNALS}

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, object]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
