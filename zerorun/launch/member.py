"""A node's launcher that joins node 0's, when every node runs its own (`peer_launch`).

    exit_code = run(recipe, role, host, nproc, secret, hello)   # joins, runs each attempt, exits with the job

It connects to node 0's launcher (retrying while node 0 is not up yet, for `launch.join_timeout_s`),
proves the job's secret and says who it is (`link.Hello`). Then, for each attempt node 0 announces
(`link.Attempt`: the job id, the nodes, the batch shape), it plans its own node's command from its own
recipe, exactly as node 0 planned it, and runs it as a local node runs: under a node supervisor
(`transport.LocalTransport`), which owns the node's processes and ends them if this launcher dies.
The node's output goes to node 0 line by line (node 0 prints it, prefixed, with everyone's) and to
this launcher's own output too (`kubectl logs` of the pod shows its node); its exit status follows
the last line. Node 0's stop and kill orders reach the node supervisor as a local launch's do.

Node 0 gone (its link closed, or silent for `HEARTBEAT_TIMEOUT_S`): this node's workers are stopped;
with `launch.max_restarts` the launcher joins node 0 again when it is back (a replaced pod), else it
exits 1 naming the lost link. SIGTERM or SIGINT (the pod deleted) stops the node, tells node 0 why
and exits 128 + the signal. At the job's end node 0 sends its exit status, which becomes this
launcher's: every node of a job exits with the same status.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, BinaryIO

from zerorun.config import Recipe
from zerorun.errors import LaunchError
from zerorun.launch import streams
from zerorun.launch.hostfile import Node
from zerorun.launch.launcher import machine_facts
from zerorun.launch.link import Attempt, Hello, Kind, Link, connect, join
from zerorun.launch.node import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S
from zerorun.launch.node_role import NodeRole
from zerorun.launch.plan import MachineFacts, NodeCommand, plan
from zerorun.launch.secret import telemetry_token
from zerorun.launch.streams import NodeBeat, NodeNote, RankExit
from zerorun.launch.transport import LocalTransport
from zerorun.telemetry import ADDRESS_ENV, TOKEN_ENV

_RETRY_S = 1.0  # between attempts to reach node 0
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class _Ending:
    """How serving node 0 ended: its exit status for the job, or (None) why node 0 was lost."""

    code: int | None
    why: str = ""


def run(recipe: Recipe, role: NodeRole, host: str, nproc: int, secret: str, hello: Hello) -> int:
    """Join node 0 and run this node's part of every attempt until node 0 says the job is over."""
    facts = machine_facts(os.cpu_count() or 1)
    timeout = recipe.launch.join_timeout_s
    while True:
        link = _join(role, secret, hello, timeout)
        ending = _Member(recipe, facts, telemetry_token(secret), link, host).serve()
        if ending.code is not None:
            return ending.code
        if not recipe.launch.max_restarts:
            _say(f"{ending.why}; this node's workers are stopped")
            return 1
        _say(f"{ending.why}; joining node 0 again when it is back (launch.max_restarts: "
             f"{recipe.launch.max_restarts}), for up to {timeout:g} s")


def _join(role: NodeRole, secret: str, hello: Hello, timeout_s: float) -> Link:
    """A proven link to node 0, hello sent; LaunchError when node 0 does not answer within `timeout_s`."""
    where = f"{role.master_addr}:{role.link_port}"
    deadline = time.monotonic() + timeout_s
    _say(f"node {role.node_rank} of {role.nnodes} ({hello.host}): joining node 0 at {where}")
    while (sock := connect(role.master_addr, role.link_port, deadline)) is None:
        if time.monotonic() + _RETRY_S > deadline:
            raise LaunchError(f"node 0's launcher at {where} did not answer within {timeout_s:g} s "
                              "(launch.join_timeout_s): is it started, and do --master-addr and --master-port "
                              "(or MASTER_ADDR and MASTER_PORT) name it on every node?")
        time.sleep(_RETRY_S)
    join(sock, secret, where)
    link = Link(sock, where)
    link.send(Kind.HELLO, hello.encode())
    return link


def command_for(recipe: Recipe, attempt: Attempt, facts: MachineFacts, token: str) -> NodeCommand:
    """This node's command in `attempt`, planned as node 0 planned it (the same `plan`, the same inputs)."""
    train = dataclasses.replace(recipe.train, micro_batch_size=attempt.micro_batch_size,
                                grad_accum_steps=attempt.grad_accum_steps)
    nodes = [Node(host, tuple(range(nproc))) for host, nproc in attempt.nodes]
    planned = plan(dataclasses.replace(recipe, train=train), nodes, attempt.job_id, attempt.master_port, facts,
                   joined=True)
    node = planned.nodes[attempt.node_index]
    telemetry = {ADDRESS_ENV: attempt.telemetry, TOKEN_ENV: token} if attempt.telemetry else {}
    return dataclasses.replace(node, env={**node.env, **telemetry})


class _Member:
    """Serves node 0 over one link: attempts, orders, heartbeats, until the job's end or node 0 is lost."""

    def __init__(self, recipe: Recipe, facts: MachineFacts, token: str, link: Link, host: str) -> None:
        self.recipe = recipe
        self.host = host
        self.facts = facts
        self.token = token
        self.link = link
        self.node: _NodeRun | None = None
        self._signals: list[int] = []

    def serve(self) -> _Ending:
        previous = {sig: signal.signal(sig, lambda signum, _frame: self._signals.append(signum))
                    for sig in _HANDLED_SIGNALS} if threading.current_thread() is threading.main_thread() else {}
        try:
            return self._loop()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _loop(self) -> _Ending:
        next_beat = time.monotonic()
        while True:
            for kind, payload in self.link.receive(0.1):
                ending = self._handle(kind, payload)
                if ending is not None:
                    return ending
            if self.node is not None and self.node.exited():
                self._finish_node()
            if self._signals:
                return self._stopped_by(self._signals[0])
            if self.link.closed or self.link.silent_s() > HEARTBEAT_TIMEOUT_S:
                why = "its launcher's connection closed" if self.link.closed else \
                    f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s"
                self._stop_node()
                self.link.release()
                return _Ending(None, f"lost contact with node 0 at {self.link.peer}: {why}")
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                self.link.send(Kind.BEAT)

    def _handle(self, kind: Kind, payload: bytes) -> _Ending | None:
        text = payload.decode("utf-8", "replace")
        if kind is Kind.ATTEMPT:
            self._stop_node()
            self._start_node(Attempt.decode(payload))
        elif kind in (Kind.STOP, Kind.KILL) and self.node is not None:
            if kind is Kind.KILL:
                self.node.hurry()
            self.node.stop_soon()
        elif kind is Kind.END:
            self._stop_node()
            self.link.release()
            return _Ending(int(text) if text.lstrip("-").isdigit() else 1)
        elif kind is Kind.REFUSE:
            self.link.release()
            raise LaunchError(f"node 0 at {self.link.peer} refused this node: {text}")
        return None

    def _start_node(self, attempt: Attempt) -> None:
        command = command_for(self.recipe, attempt, self.facts, self.token)
        _say(f"job {attempt.job_id}: node {attempt.node_index} of {len(attempt.nodes)}, ranks "
             f"{command.first_rank}-{command.first_rank + command.nproc - 1}")
        try:
            self.node = _NodeRun(command, attempt.job_id, self.recipe.launch.kill_grace_s, self.link)
        except LaunchError as exc:
            self.link.send(Kind.ERR, streams.note(f"{command.host}: {exc}"))
            self.link.send(Kind.EXIT, b"1")

    def _stop_node(self) -> None:
        if self.node is not None:
            self.node.stop_soon()
            self._finish_node()

    def _finish_node(self) -> None:
        assert self.node is not None
        code = self.node.finish()
        self.node = None
        self.link.send(Kind.EXIT, str(code).encode())

    def _stopped_by(self, signum: int) -> _Ending:
        name = signal.Signals(signum).name
        self.link.send(Kind.ERR, streams.note(f"the launcher on {self.host} received {name}; stopping its node"))
        self._stop_node()
        self.link.release()
        return _Ending(128 + signum)


class _NodeRun:
    """This node's part of one attempt: its node supervisor, and its output on the way to node 0."""

    def __init__(self, command: NodeCommand, job_id: str, kill_grace_s: float, link: Link) -> None:
        self.grace = kill_grace_s
        self.transport = LocalTransport(command.host, job_id, command.argv[0], kill_grace_s)
        out, err = self.transport.start(command)
        self._relays = [_relay(out, Kind.OUT, link, sys.stdout.buffer), _relay(err, Kind.ERR, link, sys.stderr.buffer)]
        self._stopping: threading.Thread | None = None

    def stop_soon(self) -> None:
        if self._stopping is None:
            self._stopping = threading.Thread(target=self.transport.stop, args=(self.grace,), daemon=True)
            self._stopping.start()

    def hurry(self) -> None:
        self.transport.hurry()

    def exited(self) -> bool:
        return self.transport.poll() is not None

    def finish(self) -> int:
        """Wait for the node supervisor and the last of its output; its exit status."""
        self.stop_soon()  # after an exit of its own too: stop() releases the heartbeats and the pipes
        assert self._stopping is not None
        self._stopping.join()
        for relay in self._relays:
            relay.join(timeout=5.0)
        code = self.transport.poll()
        return 1 if code is None else code


def _relay(stream: IO[bytes], kind: Kind, link: Link, sink: BinaryIO) -> threading.Thread:
    """Every line of `stream` to node 0, and the lines a person reads to `sink` too."""
    def copy() -> None:
        with stream:
            for line in stream:
                link.send(kind, line)
                shown = _shown(line.rstrip(b"\n"))
                if shown is not None:
                    try:
                        sink.write(shown + b"\n")
                        sink.flush()
                    except (OSError, ValueError):
                        pass

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _shown(line: bytes) -> bytes | None:
    """What this node's own output shows of a line: worker and torchrun lines, notes; not the records."""
    item = streams.parse(line)
    if isinstance(item, (NodeBeat, RankExit)):
        return None
    if isinstance(item, NodeNote):
        return f"zerorun: {item.text}".encode()
    return line


def _say(message: str) -> None:
    print(f"zerorun: {message}", file=sys.stderr, flush=True)
