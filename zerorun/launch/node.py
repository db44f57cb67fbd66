"""The node supervisor: `python -m zerorun.launch.node`, the one process per node that owns the node's job.

Every node runs its torchrun under one: a local node as the launcher's child, another host
through `ssh host` (the same program), and a Slurm step's node entry (`zerorun.launch.slurm`)
through `run_node`. Why a process of its own and not the launcher directly: the node must end
its job even when the launcher cannot (killed by SIGKILL in the middle of its grace period, or
gone with its ssh connection). An `ssh` client that dies does not reliably end the remote
command, and a torchrun told to stop by SIGTERM leaves workers that ignore it running.

1. It reads one JSON line from stdin, the `NodeJob`: argv, env, cwd, kill_grace_s, slots and
   offload_dirs (the environment travels on stdin, not on the command line, so `ps` on the node
   does not show it).
2. It leaves the launcher's session (`setsid`), maps the slots onto this node's GPUs
   (`devices.visible_devices`), and runs torchrun through `NodeProcesses`, copying its stdout and
   stderr to its own (worker lines already carry their `[host:rank]` prefix). Every second it
   writes a heartbeat record on stderr, so the launcher can tell a silent node from a lost one.
3. The launcher writes a heartbeat line every second on stdin; `stop` asks for an orderly stop,
   `kill` (a second Ctrl-C) for SIGKILL now. Stdin reaching EOF (the launcher is gone, or the
   connection), no heartbeat for `--heartbeat-timeout` seconds (a half-open connection), or
   SIGTERM/SIGINT/SIGHUP end the job the same way: SIGTERM to the job's processes on this node,
   SIGKILL after the grace period, every process carrying the job's id and this node's host.
   The recipe (JSON in the job's environment) goes to the workers as a file, `recipe.json` (0600) in a
   directory of the job's own (0700, under the temporary directory), named by ZERORUN_RECIPE_FILE:
   one environment variable holds at most 128 KiB on Linux, and a large recipe failed to start.
4. It removes the node's NVMe offload files (whatever the ending: the workers may be dead) and
   says so, then exits with torchrun's status (128+N when torchrun died of signal N).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import IO, BinaryIO

from zerorun import offload_files
from zerorun.config import BACKEND_ENV, RECIPE_ENV, RECIPE_FILE_ENV
from zerorun.errors import LaunchError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV, SHM_DIR, devices, shm_prefix, streams
from zerorun.launch.processes import NodeProcesses

HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0
MODULE = "zerorun.launch.node"


@dataclass(frozen=True)
class NodeJob:
    """What a node supervisor runs (the launcher's JSON header, or a Slurm step's arguments)."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    kill_grace_s: float
    slots: tuple[int, ...] | None = None  # None: leave CUDA_VISIBLE_DEVICES as it is (Slurm sets it)
    offload_dirs: tuple[str, ...] = ()

    def header(self) -> bytes:
        fields = {"argv": list(self.argv), "env": dict(self.env), "cwd": self.cwd, "kill_grace_s": self.kill_grace_s,
                  "slots": None if self.slots is None else list(self.slots), "offload_dirs": list(self.offload_dirs)}
        return json.dumps(fields).encode() + b"\n"

    @classmethod
    def from_header(cls, line: bytes) -> NodeJob:
        data = json.loads(line or b"null")
        slots = data.get("slots")
        return cls(tuple(data["argv"]), dict(data["env"]), str(data["cwd"]), float(data["kill_grace_s"]),
                   None if slots is None else tuple(int(s) for s in slots), tuple(data.get("offload_dirs") or ()))


class StopOrder:
    """Why the node must stop (first reason wins) and whether right now; set from signal handlers,
    the stdin thread and the main loop."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.at_once = threading.Event()

    def stop(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason

    def kill(self, reason: str) -> None:
        self.stop(reason)
        self.at_once.set()

    def on_signals(self, *signals: int) -> None:
        """The first of these signals stops the node, a second one kills it."""
        def handle(signum: int, _frame: object) -> None:
            why = f"received {signal.Signals(signum).name}"
            self.kill(why) if self.reason is not None else self.stop(why)

        for sig in signals:
            signal.signal(sig, handle)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}")
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S)
    args = parser.parse_args(argv)
    sys.exit(supervise(sys.stdin.fileno(), args.heartbeat_timeout))


def supervise(stdin_fd: int, heartbeat_timeout_s: float) -> int:
    """Run the node's job read from `stdin_fd` until it ends or the launcher is gone.

    Stdin is read with `os.read`, never through `sys.stdin`: a daemon thread blocked inside a
    buffered reader makes the interpreter abort at exit.
    """
    job_id, host = os.environ.get(JOB_ID_ENV), os.environ.get(NODE_HOST_ENV)
    if not job_id or not host:
        return _fail(f"{JOB_ID_ENV} and {NODE_HOST_ENV} must be set (the launcher sets them).")
    try:
        os.setsid()  # out of the launcher's (or ssh's) session: their hang-up handling must not decide for us
    except OSError:
        pass  # already a session leader
    order = StopOrder()
    order.on_signals(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    try:
        job = NodeJob.from_header(_read_line(stdin_fd))
    except (ValueError, KeyError, TypeError) as exc:
        return _fail(f"no valid job description on stdin ({exc!r}).")
    try:
        os.chdir(job.cwd)
    except OSError as exc:
        return _fail(f"cannot enter the working directory {job.cwd} on {host}: {exc.strerror or exc}.")
    last_beat = [time.monotonic()]
    threading.Thread(target=_watch_stdin, args=(stdin_fd, last_beat, order), daemon=True).start()

    def check_heartbeat() -> None:
        if time.monotonic() - last_beat[0] > heartbeat_timeout_s:
            order.stop(f"no heartbeat from the launcher for {heartbeat_timeout_s:g} s")

    return run_node(job, job_id, host, order, check_heartbeat)


def run_node(job: NodeJob, job_id: str, host: str, order: StopOrder, watch: Callable[[], None] = lambda: None) -> int:
    """Run the job's command, its output copied to ours, until it exits or `order` says stop (`watch`
    runs every 0.1 s and may say so); then end every process of the job on this node, remove its
    offload files and return the command's status (128+N when it died of signal N)."""
    try:
        env = _with_devices(job, host)
    except LaunchError as exc:
        return _fail(str(exc))
    processes = NodeProcesses(host, job_id, hurry=order.at_once)
    private = tempfile.mkdtemp(prefix=f"zerorun-{job_id}-")  # 0700, this user's: the job's own files
    try:
        env = _recipe_to_file(env, private)
        out, err = processes.start(job.argv, env)
    except (LaunchError, OSError) as exc:
        shutil.rmtree(private, ignore_errors=True)
        return _fail(str(exc))
    relays = [_copy_in_background(out, sys.stdout.buffer), _copy_in_background(err, sys.stderr.buffer)]
    beating = threading.Event()
    threading.Thread(target=_beat, args=(beating,), daemon=True).start()
    while processes.poll() is None and order.reason is None:
        watch()
        time.sleep(0.1)
    if order.reason is not None and order.reason != LAUNCHER_STOP:
        _note(f"{order.reason}; stopping job {job_id} on {host}")
    processes.stop(job.kill_grace_s)  # after a clean exit too: whatever the workers left running
    for relay in relays:
        relay.join(timeout=2.0)
    _remove_offload_files(job.offload_dirs, host)
    remove_shm_segments(job_id)
    shutil.rmtree(private, ignore_errors=True)
    beating.set()
    code = processes.poll()
    if code is None:
        return 1
    return code if code >= 0 else 128 - code


LAUNCHER_STOP = "the launcher stopped the job"


def _with_devices(job: NodeJob, host: str) -> dict[str, str]:
    """The job's environment, with its slots as this node's CUDA_VISIBLE_DEVICES where it has GPUs."""
    env = dict(job.env)
    if job.slots is not None:
        visible = env.get(devices.VISIBLE, os.environ.get(devices.VISIBLE))
        share = env.get(BACKEND_ENV) == "gloo"  # launch.backend: gloo lets ranks share a GPU
        mapped = devices.visible_devices(host, job.slots, visible, devices.gpu_count(), share)
        if mapped is not None:
            env[devices.VISIBLE] = mapped
    return env


def remove_shm_segments(job_id: str, directory: str = SHM_DIR) -> list[str]:
    """Delete the job's shared-memory segments still in `directory` (a rank killed while the ranks
    mapped one); return their names."""
    prefix = shm_prefix(job_id)
    removed = []
    try:
        names = [name for name in os.listdir(directory) if name.startswith(prefix)]
    except OSError:
        return []
    for name in names:
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            continue
    return removed


def _recipe_to_file(env: dict[str, str], directory: str) -> dict[str, str]:
    """The environment with the recipe moved out of it into `directory`/recipe.json (0600)."""
    recipe = env.pop(RECIPE_ENV, None)
    if recipe is None:
        return env
    path = os.path.join(directory, "recipe.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(recipe)
    return {**env, RECIPE_FILE_ENV: path}


def _remove_offload_files(directories: tuple[str, ...], host: str) -> None:
    if not directories:
        return
    removed = offload_files.remove_rank_dirs(directories)
    if removed:
        _note(f"removed {len(removed)} NVMe offload file(s) of this job on {host}: "
              f"{offload_files.describe(removed)}")


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read a byte at a time so that nothing after it is consumed."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return bytes(line)


def _watch_stdin(fd: int, last_beat: list[float], order: StopOrder) -> None:
    """Any line is a heartbeat; `stop` and `kill` are orders; EOF means the launcher (or its link) is gone."""
    pending = b""
    try:
        while chunk := os.read(fd, 4096):
            last_beat[0] = time.monotonic()
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                if line == b"stop":
                    order.stop(LAUNCHER_STOP)
                elif line == b"kill":
                    order.kill(LAUNCHER_STOP)
    except OSError:
        pass
    order.stop("the launcher closed the connection")


def _beat(done: threading.Event) -> None:
    """A heartbeat at once (the launcher starts the next node when it hears this one), then every second."""
    _write_stderr(streams.BEAT_RECORD + b"\n")
    while not done.wait(HEARTBEAT_S):
        _write_stderr(streams.BEAT_RECORD + b"\n")


_STDERR = threading.Lock()


_STDOUT = threading.Lock()


def _write_stderr(data: bytes) -> bool:
    """One whole record or line on stderr (heartbeats, notes and torchrun's lines never interleave)."""
    return streams.write_whole(sys.stderr.buffer, data, _STDERR)


def _copy_in_background(source: IO[bytes], sink: BinaryIO) -> threading.Thread:
    lock = _STDERR if sink is sys.stderr.buffer else _STDOUT

    def copy() -> None:
        writable = True
        with source:
            for line in source:
                if writable:  # once the connection is gone keep reading, so torchrun never blocks
                    writable = streams.write_whole(sink, line, lock)

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _note(message: str) -> None:
    _write_stderr(streams.note(message))


def _fail(message: str) -> int:
    _note(message)
    return 1


if __name__ == "__main__":
    main()
