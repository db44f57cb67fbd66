"""Transports: how one node's command is started and how everything it started is ended.

The supervisor only sees the `Transport` interface: `start` a node's command and get its output
streams, `poll` for its exit, `stop` it. `LocalTransport` runs the command as a child process;
`zerorun.launch.ssh.SSHTransport` runs it on another host under a remote supervisor
(`zerorun.launch.remote`), which uses a `LocalTransport` there; `zerorun.launch.slurm.SlurmTransport`
runs one srun step that does the same on every node of a Slurm allocation.

Ending a local job leaves nothing behind, whatever the workers do:
- torchrun starts every worker in a *new session* (its own process group), so signalling
  torchrun's group does not reach the workers, and a worker's own children (dataloader workers)
  sit in the worker's group. So `stop` collects the processes first: torchrun, all its
  descendants (a psutil tree walk), and every process whose environment carries this job's
  `ZERORUN_JOB_ID` and this node's `ZERORUN_NODE_HOST` (orphans whose parent already died and
  were re-parented away from the tree; the host keeps two nodes on one machine apart).
- It signals each of their process groups (never the launcher's own) and each process, SIGTERM
  first, then SIGKILL to whatever is still alive after the grace period, re-collecting in case a
  dying process started another. Workers that ignore SIGTERM therefore still die.
- Processes are only ever chosen by ancestry or by the job id in their environment, never by
  matching command lines, so other jobs on the machine are safe.
"""

from __future__ import annotations

import abc
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable
from typing import IO

import psutil

from zerorun.errors import LaunchError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV
from zerorun.launch.plan import LaunchPlan, NodeCommand

_KILL_WAIT_S = 5.0  # after SIGKILL: the kernel needs a moment to reap


class Transport(abc.ABC):
    """Runs one node's command; owns every process that command starts."""

    what = "torchrun"  # what ran the node's command, for reports ("torchrun on HOST failed")

    def __init__(self, host: str, job_id: str) -> None:
        self.host = host
        self.job_id = job_id

    @abc.abstractmethod
    def start(self, node: NodeCommand) -> tuple[IO[bytes], IO[bytes]]:
        """Start the node's command; return its stdout and stderr streams."""

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The command's exit status, or None while it runs."""

    @abc.abstractmethod
    def stop(self, grace_s: float) -> int:
        """End everything the command started: SIGTERM, then SIGKILL after `grace_s`.

        Returns how many of its processes were still running when it was called.
        """


def transport_for(node: NodeCommand, launch_plan: LaunchPlan) -> Transport:
    """The transport that reaches `node`'s host: an srun step, SSH when the plan says so, else a local process."""
    if node.step_nodes:
        from zerorun.launch.slurm import SlurmTransport  # it imports this module

        return SlurmTransport(node.host, launch_plan.job_id)
    if node.over_ssh:
        from zerorun.launch.ssh import SSHTransport  # it imports this module

        return SSHTransport(node.host, launch_plan.job_id, launch_plan.ssh, launch_plan.kill_grace_s)
    return LocalTransport(node.host, launch_plan.job_id)


class LocalTransport(Transport):
    """The node's torchrun as a child process in its own session."""

    def __init__(self, host: str, job_id: str) -> None:
        super().__init__(host, job_id)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, node: NodeCommand) -> tuple[IO[bytes], IO[bytes]]:
        try:
            self._proc = subprocess.Popen(
                node.argv, env={**os.environ, **node.env}, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # the terminal's Ctrl-C reaches the launcher only; it decides
                preexec_fn=_die_with_parent,
            )
        except OSError as exc:
            raise LaunchError(f"host {self.host}: cannot start {node.argv[0]}: {exc.strerror or exc}.") from None
        assert self._proc.stdout is not None and self._proc.stderr is not None
        return self._proc.stdout, self._proc.stderr

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def stop(self, grace_s: float) -> int:
        running = self._job_processes()
        if running:
            _signal_all(running, signal.SIGTERM)
            still = _wait_gone(running, grace_s, reap=self.poll)
            for _ in range(3):  # a dying process may have started another: collect again each round
                still = list({p.pid: p for p in still + self._job_processes()}.values())
                if not still:
                    break
                _signal_all(still, signal.SIGKILL)
                still = _wait_gone(still, _KILL_WAIT_S, reap=self.poll)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=_KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                pass
        return len(running)

    def _job_processes(self) -> list[psutil.Process]:
        """torchrun, its descendants, and every other live process carrying this job's id."""
        found: dict[int, psutil.Process] = {}
        if self._proc is not None and self._proc.poll() is None:
            try:
                root = psutil.Process(self._proc.pid)
                found[root.pid] = root
                found.update((p.pid, p) for p in root.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        found.update((p.pid, p) for p in processes_with_job_id(self.job_id, self.host))
        found.pop(os.getpid(), None)
        return [p for p in found.values() if _alive(p)]


def processes_with_job_id(job_id: str, host: str | None = None) -> list[psutil.Process]:
    """Live processes (of this user) whose environment has ZERORUN_JOB_ID=job_id (and, given a
    host, ZERORUN_NODE_HOST=host)."""
    matches = []
    for proc in psutil.process_iter(["environ"], ad_value=None):
        env = proc.info.get("environ")
        if env and env.get(JOB_ID_ENV) == job_id and (host is None or env.get(NODE_HOST_ENV) == host):
            matches.append(proc)
    return matches


def _signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
    """Send `sig` to each process's group (never our own) and to each process."""
    own_group = os.getpgrp()
    groups = set()
    for proc in procs:
        try:
            groups.add(os.getpgid(proc.pid))
        except OSError:
            pass
    for group in groups - {own_group}:
        try:
            os.killpg(group, sig)
        except OSError:
            pass
    for proc in procs:
        try:
            proc.send_signal(sig)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def _wait_gone(procs: list[psutil.Process], timeout: float, reap: Callable[[], object]) -> list[psutil.Process]:
    """Wait until `procs` have exited (zombies count as gone); return those still alive."""
    deadline = time.monotonic() + timeout
    alive = procs
    while True:
        reap()  # our own child must be waited for, or it stays a zombie
        alive = [p for p in alive if _alive(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _load_libc()  # loaded here, not in the forked child, where taking locks is unsafe


def _die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child before exec: get `sig` if the launcher dies (even by SIGKILL), so torchrun
    stops its workers instead of running on unsupervised (Linux only; a no-op elsewhere)."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(1, int(sig))  # PR_SET_PDEATHSIG
