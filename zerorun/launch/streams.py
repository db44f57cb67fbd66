"""Per-rank output: each worker relays its stdout/stderr as `[host:rank] line`; the launcher reads them.

Both sides of that small protocol live here: `relay_from_child()` runs in the worker, `parse()` in
the launcher.

Why a relay *process* in every worker, rather than torchrun's `--tee`/`--redirects` or a thread:
- torchrun's `--tee`/`--redirects` send each rank's output to log files that a thread in the
  agent tails onto its own output. The prefix (`TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`) and the
  log-dir layout have moved between torch 2.x releases, and what the thread has not copied yet
  is lost when the agent itself is killed, which is exactly when a failing rank's last words
  matter.
- a reader thread inside the worker dies with the worker: a segfault, `os._exit` or SIGKILL loses
  whatever was still in the pipe.
So the process torchrun starts forks first thing, before torch is imported. The child becomes the
worker, with fds 1 and 2 `dup2`'d onto pipes, so C/C++ output (NCCL, gloo, kernels) is caught too.
The parent (the relay) writes every complete line with its prefix to its own stdout/stderr (which
are torchrun's, which are the launcher's pipes); one `write` of at most PIPE_BUF bytes is atomic,
so lines of different ranks never interleave mid-line. When the worker has ended, the relay
forwards what is left, appends an *exit record* (rank, exit code or signal, and whether a SIGKILL was the kernel's OOM killer:
`oom`) to stderr and exits
with the same code (128 + N for signal N). From that record the launcher knows which rank failed
first and how; torchrun itself only exits 1 on any worker failure.

The relay ignores SIGINT/SIGTERM/SIGHUP so that it outlives its worker long enough to forward the
worker's last lines; it shares the worker's process group, so the launcher's SIGKILL ends it too.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Protocol

from zerorun.launch import warm

EXIT_RECORD = b"\x1ezerorun-exit "  # starts with ASCII record separator: no user output looks like it
BEAT_RECORD = b"\x1ezerorun-beat"  # the node supervisor is alive (every second, on its stderr)
NOTE_RECORD = b"\x1ezerorun-note "  # the node supervisor says something the launcher always shows
PIPE_BUF = 4096  # writes up to this size to a pipe are atomic (POSIX guarantees >= 512, Linux 4096)
_PREFIX = re.compile(rb"^\[([^\]\s]+):(\d+)\] ")
# torchrun's line when it sees a worker fail (this spelling since torch 1.9): "failed (exitcode: -9) local_rank: 1 (pid: N)"
_TORCHRUN_FAILED = re.compile(rb"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid")
_TORCHRUN_TEARDOWN = re.compile(rb"Sending process \d+ closing signal SIG")  # a worker exited: torchrun ends the rest
_DRAIN_S = 1.0  # after the worker ended: how long to wait for output its own children still write


def prefix(host: str, rank: int | str) -> bytes:
    return f"[{host}:{rank}] ".encode()


# ---------------------------------------------------------------------------------------------
# Worker side


def relay_from_child(host: str, rank_name: int | str, exit_record: bool) -> None:
    """Fork. Return in the child, which runs the worker with its output piped to the parent.

    The parent prefixes that output onto the real stdout/stderr, writes the exit record (when
    `exit_record`) and exits with the child's status; it never returns.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    from zerorun.launch import oom

    kills_before, started = oom.oom_kills(), time.monotonic()
    rank = warm.request_rank(out_w, err_w)  # forked by the node's zygote, torch already imported
    if rank is None:
        pid = os.fork()
        if pid == 0:
            os.dup2(out_w, 1)
            os.dup2(err_w, 2)
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            return
        child: _Child = _OwnChild(pid)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)  # they reach the worker through our shared process group
    else:
        pid, child = rank.pid, rank
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, lambda signum, _frame: rank.signal(signum))  # its group is not ours: pass them on
    os.close(out_w)
    os.close(err_w)
    status = _relay(child, prefix(host, rank_name), {out_r: 1, err_r: 2})
    code = os.waitstatus_to_exitcode(status)
    if exit_record:
        record = {"host": host, "rank": int(rank_name), "code": code if code >= 0 else None,
                  "signal": -code if code < 0 else None,
                  "oom": code == -signal.SIGKILL and oom.killed_by_oom(pid, kills_before, started)}
        _write(2, EXIT_RECORD + json.dumps(record).encode() + b"\n")
    # A signal death is reported as 128+N rather than re-raised: re-raising SIGSEGV would dump core twice.
    os._exit(code if code >= 0 else 128 - code)


class _Child(Protocol):
    """The worker the relay waits for: its own child, or one the node's zygote forked (`warm.Rank`)."""

    def exit_fds(self) -> list[int]: ...  # readable once it has ended (none: poll)
    def poll(self) -> int | None: ...  # its wait status, or None while it runs
    def wait(self) -> int: ...


class _OwnChild:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd = warm.pidfd(pid)

    def exit_fds(self) -> list[int]:
        return [self._pidfd] if self._pidfd is not None else []

    def poll(self) -> int | None:
        waited, status = os.waitpid(self.pid, os.WNOHANG)
        return status if waited else None

    def wait(self) -> int:
        return os.waitpid(self.pid, 0)[1]


def _relay(child: _Child, line_prefix: bytes, sources: dict[int, int]) -> int:
    """Copy `sources` (pipe fd -> destination fd) line by line with a prefix until the child ends.

    Returns the child's wait status. After the child has exited, output its own children still
    write is forwarded until the pipes close or go quiet, for at most `_DRAIN_S`.
    """
    selector = selectors.DefaultSelector()
    for fd in sources:
        selector.register(fd, selectors.EVENT_READ)
    exit_fds = child.exit_fds()
    for fd in exit_fds:
        selector.register(fd, selectors.EVENT_READ)
    partial = {fd: b"" for fd in sources}

    def forward(ready: list[tuple[selectors.SelectorKey, int]]) -> None:
        for key, _ in ready:
            chunk = b"" if key.fd in exit_fds else _read(key.fd)
            if not chunk:  # end of that pipe, or the child's exit descriptor saying it ended
                selector.unregister(key.fd)
                continue
            lines = (partial[key.fd] + chunk).split(b"\n")
            partial[key.fd] = lines.pop()
            if len(partial[key.fd]) >= PIPE_BUF:  # an endless line (a progress bar): pass it on in pieces
                lines.append(partial[key.fd])
                partial[key.fd] = b""
            _write_lines(sources[key.fd], line_prefix, lines)

    def open_sources() -> bool:
        return any(fd in selector.get_map() for fd in sources)

    status: int | None = None
    while status is None:
        if not open_sources():
            status = child.wait()  # the child closed its output: only its exit is left
            break
        watching_exit = any(fd in selector.get_map() for fd in exit_fds)
        forward(selector.select(None if watching_exit else 0.1))
        status = child.poll()
    deadline = time.monotonic() + _DRAIN_S
    while open_sources() and time.monotonic() < deadline:
        ready = selector.select(0.2)
        if not ready:
            break  # quiet: whatever still holds the pipe is not the worker
        forward(ready)
    for fd, rest in partial.items():
        if rest:
            _write_lines(sources[fd], line_prefix, [rest])
    selector.close()
    return status


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def _write_lines(fd: int, line_prefix: bytes, lines: list[bytes]) -> None:
    """Write prefixed lines in as few writes as possible, none larger than PIPE_BUF unless one line is."""
    batch = b""
    for line in lines:
        item = line_prefix + line + b"\n"
        if batch and len(batch) + len(item) > PIPE_BUF:
            _write(fd, batch)
            batch = b""
        batch += item
    if batch:
        _write(fd, batch)


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except InterruptedError:
            continue
        except OSError:
            return  # nobody is reading any more (launcher gone): drop the output, keep relaying the exit


def write_whole(stream: IO[bytes], data: bytes, lock: threading.Lock) -> bool:
    """Write and flush `data` to a pipe under `lock` (lines of several threads never interleave);
    False once the other end is gone."""
    with lock:
        try:
            stream.write(data)
            stream.flush()
            return True
        except (OSError, ValueError):
            return False


# ---------------------------------------------------------------------------------------------
# Launcher side


@dataclass(frozen=True)
class RankLine:
    """A line one rank printed (the prefix is kept: the launcher prints the line as it is)."""

    host: str
    rank: int
    line: bytes


@dataclass(frozen=True)
class RankExit:
    """A rank's worker ended: its exit code, or the signal that killed it."""

    host: str
    rank: int
    code: int | None
    signal: int | None
    by_torchrun: bool = False  # no record of its own (its relay died with it): torchrun's line said how it ended
    oom: bool = False  # SIGKILLed by the kernel's out-of-memory killer (see `oom`)

    @property
    def failed(self) -> bool:
        return self.code != 0

    @property
    def exit_status(self) -> int:
        """What a shell would report: the exit code, or 128 + the signal number."""
        return self.code if self.code is not None else 128 + (self.signal or 0)

    def describe(self) -> str:
        if self.code is not None:
            return f"exit code {self.code}"
        try:
            name = signal.Signals(self.signal or 0).name
        except ValueError:
            name = f"signal {self.signal}"
        if self.oom:
            return f"out of memory: killed by the kernel's OOM killer ({name})"
        return f"killed by {name}" + ("; its output relay died with it, torchrun saw the exit" if self.by_torchrun else "")


def torchrun_tearing_down(line: bytes) -> bool:
    """Whether torchrun's line is its teardown after a worker exited ("Sending process N closing signal SIGTERM"),
    which it writes before the line saying which rank failed: the start of its report, held with the rest."""
    return _TORCHRUN_TEARDOWN.search(line) is not None


def torchrun_exit(line: bytes, host: str, first_rank: int) -> RankExit | None:
    """The rank torchrun's own output says failed, and how, or None.

    A rank's relay writes its exit record; a SIGKILL that takes the relay too (the process torchrun
    started, or the whole process group) leaves none, and torchrun's line is the only witness.
    """
    match = _TORCHRUN_FAILED.search(line)
    if match is None:
        return None
    code = int(match.group(1))
    return RankExit(host, first_rank + int(match.group(2)), code if code >= 0 else None, -code if code < 0 else None,
                    by_torchrun=True)


@dataclass(frozen=True)
class NodeBeat:
    """The node supervisor's heartbeat: the link to the node works."""


@dataclass(frozen=True)
class NodeNote:
    """A message of the node supervisor (a cleanup done, why it stopped the node)."""

    text: str


def note(text: str) -> bytes:
    """A `NodeNote` as the node supervisor writes it (one line)."""
    return NOTE_RECORD + json.dumps({"text": text}).encode() + b"\n"


def parse(line: bytes) -> RankLine | RankExit | NodeBeat | NodeNote | None:
    """What a line from a node is: a rank's output or exit record, the node supervisor's heartbeat or
    note, or None (torchrun's own output)."""
    if line.startswith(BEAT_RECORD):
        return NodeBeat()
    if line.startswith(NOTE_RECORD):
        try:
            return NodeNote(str(json.loads(line[len(NOTE_RECORD):])["text"]))
        except (ValueError, KeyError, TypeError):
            return None
    if line.startswith(EXIT_RECORD):
        try:
            data = json.loads(line[len(EXIT_RECORD):])
            return RankExit(str(data["host"]), int(data["rank"]), data["code"], data["signal"], oom=bool(data.get("oom")))
        except (ValueError, KeyError, TypeError):
            return None
    match = _PREFIX.match(line)
    if match is None:
        return None
    return RankLine(match.group(1).decode(errors="replace"), int(match.group(2)), line)
