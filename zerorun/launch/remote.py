"""The remote supervisor: what `ssh host` runs on every other node, `python -m zerorun.launch.remote`.

Why it exists: an `ssh` client that dies (SIGKILL, a dropped link) does not reliably end the
remote command. Without a tty the remote side gets no signal at all and runs on as an orphan;
with `-tt` it gets SIGHUP, which torchrun's workers (in sessions of their own) never see. So the
remote end of the job is a small supervisor that owns the node's processes and ends them itself:

1. It reads one JSON line from stdin: `{"argv", "env", "cwd", "kill_grace_s"}` (the environment
   travels on stdin, not on the command line, so that `ps` on the node does not show it).
2. It leaves the ssh session (`setsid`), then runs torchrun through a `LocalTransport`, exactly as
   a local launch does, and copies torchrun's stdout and stderr to its own (worker lines already
   carry their `[host:rank]` prefix).
3. The launcher keeps stdin open and writes a heartbeat line every second. Stdin reaching EOF
   (the launcher closed it to stop the job, or the connection is gone), no heartbeat for
   `--heartbeat-timeout` seconds (a half-open connection), or SIGTERM/SIGINT/SIGHUP all end the
   job the same way: `LocalTransport.stop` (SIGTERM to the job's process groups, SIGKILL after the
   grace period, every process carrying this job's id and this node's host).
4. It exits with torchrun's status (128+N when torchrun died of signal N).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, BinaryIO

from zerorun.errors import LaunchError
from zerorun.launch import JOB_ID_ENV, NODE_HOST_ENV
from zerorun.launch.plan import NodeCommand
from zerorun.launch.transport import LocalTransport

HEARTBEAT_TIMEOUT_S = 10.0
PREFIX = "zerorun-remote"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zerorun.launch.remote")
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_S)
    args = parser.parse_args(argv)
    sys.exit(supervise(sys.stdin.fileno(), args.heartbeat_timeout))


def supervise(stdin_fd: int, heartbeat_timeout_s: float) -> int:
    """Run the node's command read from `stdin_fd` until it ends or the launcher is gone.

    Stdin is read with `os.read`, never through `sys.stdin`: a daemon thread blocked inside a
    buffered reader makes the interpreter abort at exit.
    """
    job_id, host = os.environ.get(JOB_ID_ENV), os.environ.get(NODE_HOST_ENV)
    if not job_id or not host:
        return _fail(f"{JOB_ID_ENV} and {NODE_HOST_ENV} must be set (the launcher sets them).")
    try:
        os.setsid()  # out of the ssh session: sshd's hang-up handling must not decide for us
    except OSError:
        pass  # already a session leader
    stop_reason: list[str] = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: stop_reason.append(f"received {signal.Signals(signum).name}"))
    try:
        header = json.loads(_read_line(stdin_fd) or b"null")
        node = NodeCommand(host, 0, 0, 0, tuple(header["argv"]), header["env"])
        grace_s = float(header["kill_grace_s"])
        os.chdir(header["cwd"])
    except (ValueError, KeyError, TypeError) as exc:
        return _fail(f"no valid job description on stdin ({exc!r}).")
    except OSError as exc:
        return _fail(f"cannot enter the working directory {header['cwd']} on {host}: {exc.strerror or exc}.")

    last_beat = [time.monotonic()]
    threading.Thread(target=_watch_stdin, args=(stdin_fd, last_beat, stop_reason), daemon=True).start()

    def check_heartbeat() -> None:
        if time.monotonic() - last_beat[0] > heartbeat_timeout_s:
            stop_reason.append(f"no heartbeat from the launcher for {heartbeat_timeout_s:g} s")

    return run_node(node, job_id, host, grace_s, stop_reason, check_heartbeat)


def run_node(node: NodeCommand, job_id: str, host: str, grace_s: float, stop_reason: list[str],
             watch: Callable[[], None] = lambda: None) -> int:
    """Run the node's command under a `LocalTransport`, its output copied to ours, until it exits or
    `stop_reason` gets an entry (`watch` runs every 0.1 s and may add one); then end every process of
    the node and return the command's status (128+N when it died of signal N).

    Shared by both ways of reaching a node from afar: this module (ssh) and `zerorun.launch.slurm` (srun).
    """
    transport = LocalTransport(host, job_id)
    try:
        out, err = transport.start(node)
    except LaunchError as exc:
        return _fail(str(exc))
    relays = [_copy_in_background(out, sys.stdout.buffer), _copy_in_background(err, sys.stderr.buffer)]
    while transport.poll() is None and not stop_reason:
        watch()
        time.sleep(0.1)
    if stop_reason:
        _say(f"{stop_reason[0]}; stopping job {job_id} on {host}")
    transport.stop(grace_s)  # after a clean exit too: whatever the workers left running
    for relay in relays:
        relay.join(timeout=2.0)
    code = transport.poll()
    if code is None:
        return 1
    return code if code >= 0 else 128 - code


def _read_line(fd: int) -> bytes:
    """One line from `fd`, read a byte at a time so that nothing after it is consumed."""
    line = bytearray()
    while not line.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            break
        line += byte
    return bytes(line)


def _watch_stdin(fd: int, last_beat: list[float], stop_reason: list[str]) -> None:
    """Anything read is a heartbeat; EOF means the launcher stopped the job or the connection is gone."""
    try:
        while os.read(fd, 4096):
            last_beat[0] = time.monotonic()
    except OSError:
        pass
    stop_reason.append("the launcher closed the connection")


def _copy_in_background(source: IO[bytes], sink: BinaryIO) -> threading.Thread:
    def copy() -> None:
        writable = True
        with source:
            for line in source:
                if writable:  # once the connection is gone keep reading, so torchrun never blocks
                    try:
                        sink.write(line)
                        sink.flush()
                    except (OSError, ValueError):
                        writable = False

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"{PREFIX}: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _fail(message: str) -> int:
    _say(message)
    return 1


if __name__ == "__main__":
    main()
