"""Which job owns a shared directory: an advisory lock the launcher holds for the job's whole life.

    claim = claim_paths(launch_plan)   # LaunchError if another live job holds one of them
    ...                                # the job runs (restarts included)
    claim.release()

Two jobs writing one `checkpoint.dir` mix their tags and delete each other's temporary
directories; two jobs of one name append to one `runs/<name>/telemetry.jsonl`. So the launcher
takes `<dir>/.zerorun-lock` with `flock` before anything starts, and writes its job id, host and
pid into it. A second launcher finds the lock taken and is refused at once, naming the first job.
The kernel releases a flock when its holder dies, however it dies (SIGKILL included): a lock
file that can be taken but still names a job is a stale lock of a job that ended without
releasing it, which is said and taken over. flock works across hosts on NFSv4 and Lustre; on a
file system where it does not, the lock guards this machine's jobs only.

The lock file's mode is 0600; it is left in place (empty) when released: removing it would race
with a launcher that has just opened it. The lock needs no bytes, only its record does: on a full disk
the lock is still taken and guards the directory, the job is told once that its record could not be
written (a second launcher is then refused without the holder's name), and the job runs.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from zerorun.errors import LaunchError
from zerorun.launch.plan import LaunchPlan
from zerorun.telemetry import RUNS_DIR

LOCK_NAME = ".zerorun-lock"


class Unlockable(LaunchError):
    """The directory cannot be created or locked from the launcher's machine (another job is not the problem)."""


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a directory."""

    job_id: str
    host: str
    pid: int
    since: float

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"job {self.job_id} (launcher pid {self.pid} on {self.host}, since {when})"

    @classmethod
    def read(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(str(data["job_id"]), str(data["host"]), int(data["pid"]), float(data["since"]))
        except (ValueError, KeyError, TypeError):
            return None


class DirectoryLock:
    """One directory's lock, held through an open descriptor."""

    def __init__(self, directory: Path, fd: int, stale: Holder | None, unrecorded: str | None = None) -> None:
        self.directory = directory
        self.stale = stale  # the job that held it last and died without releasing it
        self.unrecorded = unrecorded  # why the holder's record could not be written (a full disk), if it could not
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass
        os.close(self._fd)  # closing drops the flock
        self._fd = None


def lock_directory(directory: str | os.PathLike, what: str, job_id: str) -> DirectoryLock:
    """Take `directory`'s lock for `job_id`; LaunchError naming the holder if a live job has it."""
    directory = Path(directory)
    path = directory / LOCK_NAME
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise Unlockable(f"{what}: cannot create {path} ({exc.strerror or exc}); nothing was started.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = Holder.read(_read_all(fd))
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise Unlockable(f"{what}: cannot lock {path} ({exc.strerror or exc}); nothing was started.") from None
        who = holder.describe() if holder else "another job"
        raise LaunchError(f"{what}: {directory} is in use by {who}; two jobs there would overwrite each other's "
                          "files. Wait for it to end or stop it, or give this job its own directory; nothing was "
                          "started.") from None
    stale = Holder.read(_read_all(fd))
    me = Holder(job_id, socket.gethostname(), os.getpid(), time.time())
    record = json.dumps({"job_id": me.job_id, "host": me.host, "pid": me.pid, "since": me.since}).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, record + b"\n", 0)
    except OSError as exc:  # a full disk: the flock holds all the same
        return DirectoryLock(directory, fd, stale, f"{path}: locked for this job, but which job holds it could not "
                                                   f"be written ({exc.strerror or exc}): a second launcher there is "
                                                   "refused without that name")
    return DirectoryLock(directory, fd, stale)


class Claim:
    """The locks of one job's shared directories."""

    def __init__(self, locks: list[DirectoryLock], notes: list[str]) -> None:
        self.locks = locks
        self.notes = notes  # stale locks taken over, in words

    def release(self) -> None:
        for lock in self.locks:
            lock.release()


def claim_paths(launch_plan: LaunchPlan, runs_dir: str | os.PathLike = RUNS_DIR) -> Claim:
    """Lock the job's `runs/<name>/` (when telemetry is on) and its `checkpoint.dir` (when set).

    A `checkpoint.dir` the launcher's machine cannot create or lock (a path that exists only on the
    nodes) is left unlocked, with a note: that is the nodes' business, and refusing the job would be wrong."""
    wanted: list[tuple[Path, str]] = []
    if launch_plan.telemetry.enabled:
        wanted.append((Path(runs_dir) / launch_plan.name, f"run name {launch_plan.name!r} (telemetry)"))
    recipe = launch_plan.inputs.recipe if launch_plan.inputs is not None else None
    if recipe is not None and recipe.checkpoint.dir:
        cwd = launch_plan.inputs.facts.cwd if launch_plan.inputs is not None else "."
        wanted.append((Path(cwd) / recipe.checkpoint.dir, "checkpoint.dir"))
    locks: list[DirectoryLock] = []
    notes: list[str] = []
    try:
        for directory, what in wanted:
            try:
                locks.append(lock_directory(directory, what, launch_plan.job_id))
            except Unlockable as exc:
                if what != "checkpoint.dir":
                    raise
                notes.append(f"{str(exc).removesuffix(' nothing was started.')} not locked: another job using it "
                             "would not be noticed")
    except LaunchError:
        for lock in locks:
            lock.release()
        raise
    notes += [f"{lock.directory}: taking over the lock of {lock.stale.describe()}, which ended without releasing "
              "it" for lock in locks if lock.stale is not None]
    notes += [lock.unrecorded for lock in locks if lock.unrecorded is not None]
    return Claim(locks, notes)


def _read_all(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode(errors="replace")
    except OSError:
        return ""
