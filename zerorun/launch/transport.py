"""Transports: how the launcher reaches one node, and how it stops it.

The supervisor only sees the `Transport` interface: `start` a node's command and get its output
streams, `poll` for its exit, `stop` it (orderly), `hurry` (a second Ctrl-C: kill now). Every node
runs under a node supervisor (`zerorun.launch.node`) that owns the node's processes and ends them
even when the launcher is gone, so the launcher's side of a node is small:

- `LocalTransport` starts the node supervisor as a child process; `zerorun.launch.ssh.SSHTransport`
  starts the same program on another host through `ssh`. Both are a `SupervisedTransport`: the
  job goes to the node supervisor as one JSON line on stdin, then a heartbeat line every second;
  `stop` writes `stop`, `hurry` writes `kill`. One thread (`Heartbeats`) beats for every node
  of the job, not one per node; after the job line, a node's stdin is non-blocking, so a node that
  stops reading costs a missed beat, never the other nodes' beats. The node supervisor writes a heartbeat record every
  second on its stderr: the supervisor notes when each node was last heard (`last_heard`), and a
  node silent for `HEARTBEAT_TIMEOUT_S` is a lost node. A stop does not wait on a node that has
  gone silent: its client is killed at once (the node ends the job by itself when the launcher's
  heartbeats stop), which keeps a half-open link from holding the teardown for the whole grace.
- `zerorun.launch.slurm.SlurmTransport` runs one srun step whose node entries do the same on every
  node of an allocation.
"""

from __future__ import annotations

import abc
import os
import subprocess
import threading
import time
from typing import IO

from zerorun.errors import LaunchError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV
from zerorun.launch.node import HEARTBEAT_S, HEARTBEAT_TIMEOUT_S, MODULE, NodeJob
from zerorun.launch.plan import NodeCommand
from zerorun.launch.processes import KILL_WAIT_S, die_with_parent, kill_job_processes
from zerorun.launch.streams import write_whole

SILENT_S = 5.0  # while stopping: a node not heard from this long has lost its link (it beats every second)
_EXIT_WAIT_S = 5.0  # after the node's grace period: for its SIGKILL round and the exit to travel back


class Transport(abc.ABC):
    """Runs one node's command; ends everything it started."""

    what = "torchrun"  # what ran the node's command, for reports ("torchrun on HOST failed")
    heartbeats = False  # the node beats every second: a silence means a lost link

    def __init__(self, host: str, job_id: str) -> None:
        self.host = host
        self.job_id = job_id
        self.last_heard = time.monotonic()  # set by the supervisor's readers on every line from the node

    @abc.abstractmethod
    def start(self, node: NodeCommand) -> tuple[IO[bytes], IO[bytes]]:
        """Start the node's command; return its stdout and stderr streams."""

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The command's exit status, or None while it runs."""

    @abc.abstractmethod
    def stop(self, grace_s: float) -> int:
        """End everything the command started: SIGTERM, then SIGKILL after `grace_s`.

        Returns 1 if the node was still running when it was called, else 0.
        """

    def hurry(self) -> None:
        """Turn a `stop` in progress (called from another thread) into SIGKILL now."""

    def request_stop(self) -> None:
        """Ask the node to stop without waiting (`stop` then waits): every node of a large job hears it
        at once, however few `stop` calls run at a time."""

    def silent_s(self) -> float:
        return time.monotonic() - self.last_heard

    def lost_link(self, silent_s: float) -> str | None:
        """Why the link to the node is gone (its client exited for that reason, or a node that beats
        has been silent for `silent_s` while running), or None."""
        if self.heartbeats and self.poll() is None and self.silent_s() > silent_s:
            return f"lost contact with {self.host}: no heartbeat for {self.silent_s():.0f} s"
        return None

    def describe_exit(self, code: int) -> str:
        """Why the node ended, for the report (`code` as `poll()` gave it)."""
        return f"{self.what} on {self.host} failed (exit code {exit_status(code)})"


def exit_status(code: int) -> int:
    """A process's exit status as a shell shows it (killed by signal N: 128+N)."""
    return code if code >= 0 else 128 - code


def bootstrap_env(node: NodeCommand) -> dict[str, str]:
    """The few variables the node supervisor needs before it reads the rest from stdin: the job id
    and host (teardown finds the node's processes by them) and what makes zerorun importable."""
    keys = (JOB_ID_ENV, NODE_HOST_ENV, "PYTHONPATH", "PATH", "VIRTUAL_ENV")
    return {key: node.env[key] for key in keys if key in node.env}


class Heartbeats:
    """One thread that writes a heartbeat to every running node each `HEARTBEAT_S` (it ends when no
    node is left, and starts again with the next)."""

    def __init__(self) -> None:
        self._nodes: set[SupervisedTransport] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, node: SupervisedTransport) -> None:
        with self._lock:
            self._nodes.add(node)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="zerorun-heartbeats", daemon=True)
                self._thread.start()

    def remove(self, node: SupervisedTransport) -> None:
        with self._lock:
            self._nodes.discard(node)

    def _run(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with self._lock:
                nodes = list(self._nodes)
                if not nodes:
                    self._thread = None
                    return
            for node in nodes:
                if not node.beat():
                    self.remove(node)


HEARTBEATS = Heartbeats()


class SupervisedTransport(Transport):
    """A node supervisor as a child process (directly, or through ssh), driven through its stdin."""

    heartbeats = True

    def __init__(self, host: str, job_id: str, kill_grace_s: float) -> None:
        super().__init__(host, job_id)
        self.kill_grace_s = kill_grace_s  # the node supervisor's, between its SIGTERM and SIGKILL
        self._proc: subprocess.Popen[bytes] | None = None
        self._stdin_lock = threading.Lock()
        self._stopped = threading.Event()
        self._hurry = threading.Event()

    @abc.abstractmethod
    def command(self, node: NodeCommand) -> tuple[list[str], dict[str, str] | None]:
        """The argv that starts the node supervisor, and its environment (None: ours)."""

    def start(self, node: NodeCommand) -> tuple[IO[bytes], IO[bytes]]:
        argv, env = self.command(node)
        try:
            self._proc = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, start_new_session=True, preexec_fn=die_with_parent)
        except OSError as exc:
            raise LaunchError(f"host {self.host}: cannot start {argv[0]}: {exc.strerror or exc}.") from None
        self.last_heard = time.monotonic()
        job = NodeJob(node.argv, node.env, node.cwd, self.kill_grace_s, node.slots, node.offload_dirs)
        assert self._proc.stdin is not None
        write_whole(self._proc.stdin, job.header(), self._stdin_lock)  # may wait for ssh to connect
        os.set_blocking(self._proc.stdin.fileno(), False)  # from here on only short lines: beats and orders
        HEARTBEATS.add(self)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        return self._proc.stdout, self._proc.stderr

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def stop(self, grace_s: float) -> int:
        """Ask the node to stop and wait for it; kill the client if the node went silent or hangs."""
        if self._proc is None:
            return 0
        running = self._proc.poll() is None
        self._send(b"stop\n")
        deadline = time.monotonic() + grace_s + KILL_WAIT_S + _EXIT_WAIT_S
        hurried = False
        while self._proc.poll() is None:
            if self.silent_s() > SILENT_S or time.monotonic() > deadline:
                self._kill_client()
                break
            if self._hurry.is_set() and not hurried:
                hurried = True
                if not self._send(b"kill\n"):
                    self._kill_client()
                    break
            time.sleep(0.05)
        self._stopped.set()
        HEARTBEATS.remove(self)
        self._close_stdin()
        self._proc.wait()
        return int(running)

    def hurry(self) -> None:
        self._hurry.set()

    def lost_link(self, silent_s: float) -> str | None:
        return None if self._proc is None else super().lost_link(silent_s)  # not started: not silent either

    def request_stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._send(b"stop\n")

    def _kill_client(self) -> None:
        """The node does not answer: end our side; it ends the job itself when our heartbeats stop."""
        assert self._proc is not None
        self._proc.kill()

    def beat(self) -> bool:
        """One heartbeat (from `HEARTBEATS`); False once the node is gone or stopped."""
        if self._stopped.is_set() or self.poll() is not None:
            return False
        if not self._stdin_lock.acquire(blocking=False):
            return True  # an order is being written: it counts as a beat
        try:
            return self._write(b"\n") is not False
        finally:
            self._stdin_lock.release()

    def _send(self, data: bytes) -> bool:
        """Write one short line (an order); False if the node cannot take it (gone, or not reading)."""
        with self._stdin_lock:
            return self._write(data) is True

    def _write(self, data: bytes) -> bool | None:
        """One atomic write of at most PIPE_BUF bytes: True, False when the pipe is gone, None when it is
        full (the node has stopped reading; its silence is what the supervisor acts on)."""
        assert self._proc is not None and self._proc.stdin is not None
        try:
            os.write(self._proc.stdin.fileno(), data)
            return True
        except BlockingIOError:
            return None
        except (OSError, ValueError):  # ValueError: our side is closed
            return False

    def _close_stdin(self) -> None:
        with self._stdin_lock:
            try:
                assert self._proc is not None and self._proc.stdin is not None
                self._proc.stdin.close()
            except (OSError, ValueError):
                pass


class LocalTransport(SupervisedTransport):
    """A node on this machine: its node supervisor as our child."""

    def __init__(self, host: str, job_id: str, python: str, kill_grace_s: float) -> None:
        super().__init__(host, job_id, kill_grace_s)
        self.python = python

    def command(self, node: NodeCommand) -> tuple[list[str], dict[str, str] | None]:
        argv = [self.python, "-m", MODULE, "--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT_S:g}"]
        return argv, {**os.environ, **bootstrap_env(node)}

    def _kill_client(self) -> None:
        super()._kill_client()
        kill_job_processes(self.job_id, self.host)  # what the node supervisor could not end, we can: same machine
