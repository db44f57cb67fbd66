"""A node's processes: start torchrun as a child, find everything of the job, end all of it.

`NodeProcesses` is what the node supervisor (`zerorun.launch.node`) runs the node's command with,
on every node (local, SSH, Slurm). Ending a job leaves nothing behind, whatever the workers do:
- torchrun starts every worker in a *new session* (its own process group), so signalling
  torchrun's group does not reach the workers, and a worker's own children (dataloader workers)
  sit in the worker's group. So `stop` collects the processes first: torchrun, all its
  descendants (a psutil tree walk), and every process whose environment carries this job's
  `ZERORUN_JOB_ID` and this node's `ZERORUN_NODE_HOST` (orphans whose parent already died and
  were re-parented away from the tree; the host keeps two nodes on one machine apart).
- It signals each of their process groups (never the caller's own) and each process, SIGTERM
  first, then SIGKILL to whatever is still alive after the grace period (at once when `hurry` is set),
  re-collecting in case a dying process started another. Workers that ignore SIGTERM still die.
- Processes are only ever chosen by ancestry or by the job id in their environment, never by
  matching command lines, so other jobs on the machine are safe.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

import psutil

from zerorun.errors import LaunchError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV

KILL_WAIT_S = 5.0  # after SIGKILL: the kernel needs a moment to reap


class NodeProcesses:
    """The node's torchrun as a child process in its own session, and everything it starts."""

    def __init__(self, host: str, job_id: str, hurry: threading.Event | None = None) -> None:
        self.host = host
        self.job_id = job_id
        self._proc: subprocess.Popen[bytes] | None = None
        self._hurry = hurry or threading.Event()  # set: a stop skips the rest of its grace period

    def start(self, argv: Sequence[str], env: Mapping[str, str]) -> tuple[IO[bytes], IO[bytes]]:
        """Start `argv` with `env` added to ours; return its stdout and stderr."""
        try:
            self._proc = subprocess.Popen(
                list(argv), env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                start_new_session=True,  # the terminal's Ctrl-C reaches the supervisor only; it decides
                preexec_fn=die_with_parent,
            )
        except OSError as exc:
            raise LaunchError(f"host {self.host}: cannot start {argv[0]}: {exc.strerror or exc}.") from None
        assert self._proc.stdout is not None and self._proc.stderr is not None
        return self._proc.stdout, self._proc.stderr

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def stop(self, grace_s: float) -> int:
        """SIGTERM to every process of the job on this node, SIGKILL after `grace_s`; how many ran."""
        running = self._job_processes()
        if running:
            signal_all(running, signal.SIGTERM)
            still = wait_gone(running, grace_s, reap=self.poll, hurry=self._hurry)
            for _ in range(3):  # a dying process may have started another: collect again each round
                still = list({p.pid: p for p in still + self._job_processes()}.values())
                if not still:
                    break
                signal_all(still, signal.SIGKILL)
                still = wait_gone(still, KILL_WAIT_S, reap=self.poll)
        if self._proc is not None:
            try:
                self._proc.wait(timeout=KILL_WAIT_S)
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
        return [p for p in found.values() if alive(p)]


def processes_with_job_id(job_id: str, host: str | None = None) -> list[psutil.Process]:
    """Live processes (of this user) whose environment has ZERORUN_JOB_ID=job_id (and, given a
    host, ZERORUN_NODE_HOST=host)."""
    matches = []
    for proc in psutil.process_iter(["environ"], ad_value=None):
        env = proc.info.get("environ")
        if env and env.get(JOB_ID_ENV) == job_id and (host is None or env.get(NODE_HOST_ENV) == host):
            matches.append(proc)
    return matches


def kill_job_processes(job_id: str, host: str) -> int:
    """SIGKILL every live process of the job's node `host` on this machine but ours; how many there were."""
    procs = [p for p in processes_with_job_id(job_id, host) if p.pid != os.getpid() and alive(p)]
    if procs:
        signal_all(procs, signal.SIGKILL)
        wait_gone(procs, KILL_WAIT_S, reap=lambda: None)
    return len(procs)


def signal_all(procs: list[psutil.Process], sig: signal.Signals) -> None:
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


def wait_gone(procs: list[psutil.Process], timeout: float, reap: Callable[[], object],
              hurry: threading.Event | None = None) -> list[psutil.Process]:
    """Wait until `procs` have exited (zombies count as gone) or `hurry` is set; return those still alive."""
    deadline = time.monotonic() + timeout
    alive_ = procs
    while True:
        reap()  # our own child must be waited for, or it stays a zombie
        alive_ = [p for p in alive_ if alive(p)]
        if not alive_ or time.monotonic() >= deadline or (hurry is not None and hurry.is_set()):
            return alive_
        time.sleep(0.05)


def alive(proc: psutil.Process) -> bool:
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


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In the child before exec: get `sig` if its parent dies (even by SIGKILL), so it stops its own
    processes instead of running on unsupervised (Linux only; a no-op elsewhere)."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(1, int(sig))  # PR_SET_PDEATHSIG
