"""Warm ranks: every rank of a node is forked from one process that has already imported torch.

A rank started as a fresh interpreter spends 2.3-2.7 s of CPU importing torch and the runtime before the
user's first line runs; on a node of 8 ranks that is 8 imports at once, fighting for the same cores. The
node's torchrun (`zerorun.launch.torchrun`) imports torch anyway. Before it starts its agent it forks the
*zygote*, which imports the rest of what a rank needs and then forks one rank per request. Measured on a
2-core machine: a launch of a tiny engine script on 2 ranks costs 2.4 s of CPU instead of 4.9
(docs/benchmarks.md, "Quick start").

What torchrun sees does not change: it starts `python -m zerorun.launch.worker` per rank, and that process
(the output relay, `streams`) is what it watches, signals and reaps. Only where the rank comes from does:

    relay (torchrun's child)  --connect-->  zygote (the node torchrun's child)
      sends: stdin, the write ends of its output pipes, a lifeline pipe, and its identity
             (environment, working directory, arguments)
                              <--"pid N"--  forks; the child takes that identity and runs the worker
                              <--"status S"- when the rank has ended: its wait status

- **Signals.** torchrun signals the relay's process group, which the forked rank is not in: the relay
  forwards SIGINT, SIGTERM and SIGHUP to the rank's group. A SIGKILL takes the relay alone; the rank holds
  the read end of the relay's lifeline pipe, and a thread of the rank kills its group (the rank and its
  children, as the relay's group SIGKILL did) the moment that pipe closes.
- **What a fresh interpreter would differ in**, and is restored in the child: the environment (and with it
  the OpenMP threads torch read at import), the working directory, signal handlers, a session of its own.
  `random` reseeds itself in a forked child; numpy's global generator and torch's CPU generator do not, and
  the child seeds them from the OS as a fresh interpreter would (torch only where it seeds so at start).
  One difference stays: what the zygote imported is frozen (`freeze_imports`), so `gc.get_freeze_count()` is not 0 and
  those objects are never collected (they are the modules', alive until the rank ends anyway).
  `/proc/<pid>/cmdline` and `environ` stay the node torchrun's: they carry the job's id,
  so the node supervisor's sweep of the job's processes still finds every rank.
- **Safe by refusal.** The zygote forks nothing once CUDA was initialised in it (a forked CUDA context is
  unusable), and a relay that cannot reach a zygote, or that loses it before it answers, forks its rank
  itself as before. `ZERORUN_WARM_RANKS=0` turns the zygote off. Warm ranks save time; they never change
  what runs.
- **Who may ask.** The socket is an abstract Unix socket with a random name; the zygote serves only peers
  of its own user id (SO_PEERCRED), who could run anything as that user anyway.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import selectors
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

ADDRESS_ENV = "ZERORUN_WARM_ADDRESS"  # set for the workers of a node whose zygote listens
SWITCH_ENV = "ZERORUN_WARM_RANKS"  # "0": every rank a fresh interpreter
_HEADER = struct.Struct("!Q")  # the identity's length, sent with the descriptors
_FDS = 5  # stdin, stdout, stderr, lifeline, exit note
_REAP_S = 2.0  # how long an ending zygote waits for ranks still dying of their lifelines
_READ_TIMEOUT_S = 5.0  # a peer that connected and stalls does not hold up the node's other ranks
# torch's fixed default seed for its CPU generator (`default_rng_seed_val`); torch 2.13 and 2.14 draw one per process
TORCH_FIXED_SEED = 67280421310721
_FORK_TIMEOUT_S = 60.0  # a relay whose zygote has not forked by then (a hung import) forks its rank itself
# What a rank imports before the user's first line (the worker bootstrap and the engine), imported once here.
PRELOAD = ("torch", "torch.distributed", "zerorun.config", "zerorun.runtime.comm.dist", "zerorun.runtime.interop",
           "zerorun.runtime.host_allocator", "zerorun.runtime.engine", "zerorun.telemetry.probe")


@dataclass
class Request:
    """What a relay asks the zygote for: a rank with the relay's identity and descriptors."""

    fds: list[int]  # stdin, stdout, stderr, lifeline (read end), exit note (write end)
    env: dict[str, str]
    cwd: str
    argv: list[str]


# ---------------------------------------------------------------------------------------------
# The node torchrun's side


def enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "1") != "0" and sys.platform == "linux"


@dataclass
class Zygote:
    """The node torchrun's handle on its zygote."""

    pid: int
    lifeline_w: int

    def stop(self, timeout_s: float = _REAP_S) -> None:
        """End it (closing its lifeline) and reap it; it first reaps the ranks it forked, for at most `timeout_s`."""
        os.close(self.lifeline_w)
        deadline = time.monotonic() + 2 * timeout_s
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG)[0]:
                return
            time.sleep(0.01)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def start(script: str | None = None) -> Zygote | Request:
    """Fork the zygote and name its socket in the environment the workers inherit. The zygote also imports the
    heavy libraries `script` imports (`warm_libraries`).

    Returns the zygote's handle in the calling process (the node torchrun, which goes on to start its agent).
    In the zygote it returns only once it has forked a rank: in that child it returns the rank's `Request`.
    The zygote itself ends when the node torchrun stops it, or is gone."""
    address = f"\0zerorun-warm-{os.getpid()}-{secrets.token_hex(8)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(256)
    agent_r, agent_w = os.pipe()  # the zygote's own lifeline: EOF once the node torchrun is gone
    freeze_imports()  # torch, imported by the node torchrun: for its agent and the zygote alike
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(agent_r)
        listener.close()
        os.environ[ADDRESS_ENV] = address[1:]
        return Zygote(pid, agent_w)
    os.close(agent_w)
    os.setsid()  # the terminal's Ctrl-C reaches torchrun, which ends the ranks its own way
    try:
        request = _zygote(listener, agent_r, script)
    except BaseException:  # noqa: BLE001 - nothing of the zygote may run on as a second torchrun
        os._exit(1)
    if request is None:
        os._exit(0)
    return request


def _zygote(listener: socket.socket, agent_r: int, script: str | None = None) -> Request | None:
    """Import what a rank needs, then serve; None at once where that fails or initialised CUDA, or where the
    script's libraries could not be imported here as in a rank (`warm_libraries`: then every rank starts fresh)."""
    try:
        for module in PRELOAD:
            __import__(module)
    except Exception:  # noqa: BLE001 - relays that find no zygote fork their ranks themselves
        return None
    import torch

    if script is not None and _libraries_refused(script):
        return None
    if torch.cuda.is_initialized():
        return None
    freeze_imports()  # and what the zygote imported since, for every rank it forks
    return _serve(listener, agent_r)


def freeze_imports() -> None:
    """Move every object alive now out of the garbage collector's reach, for the rest of this process and of those
    it forks (`gc.freeze`, Python's own advice before a fork without exec). Called where what is alive is what was
    imported (here before a fork, the worker before the script), so they are the modules', alive as long as the
    process anyway. Left in the collector's oldest generation, every full collection walks them (torch alone leaves
    over 100,000): the one each process makes at exit, and a script's own. In a forked process each such walk also
    writes to every page it visits
    (the collector's marks), so that the kernel copies them from the parent. Measured with a 2-rank launch of a
    script that prints one line (`zerorun launch --num_gpus 2 hello.py`, CPU from process accounting): 0.70-0.78
    s of CPU per rank, 0.22 frozen; the node torchrun and its zygote together 0.4 s less."""
    import gc

    gc.collect()  # what is garbage already goes now, rather than never
    gc.freeze()


def _libraries_refused(script: str) -> bool:
    from zerorun import config
    from zerorun.launch import warm_libraries

    try:
        recipe = config.from_env()
        why = warm_libraries.import_for(script, recipe is not None and recipe.launch.deepspeed_compat)
    except Exception as exc:  # noqa: BLE001 - each rank reads its recipe itself, and reports what is wrong
        why = f"{type(exc).__name__}: {exc}"
    if why:
        print(f"zerorun: every rank of this node imports its own libraries: {why}", file=sys.stderr, flush=True)
    return why is not None


def _serve(listener: socket.socket, agent_r: int) -> Request | None:
    """Fork a rank per request; tell each relay its rank's pid, then its wait status. Returns in a child only."""
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(agent_r, selectors.EVENT_READ)
    ranks: dict[int, socket.socket] = {}
    while True:
        for key, _ in selector.select(0.1 if ranks else None):
            if key.fileobj == agent_r:  # the node torchrun ended: its ranks end with their relays
                _reap(ranks, time.monotonic() + _REAP_S)
                return None
            conn, _ = listener.accept()
            request = _read_request(conn)
            if request is None:
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                os.close(agent_r)
                for other in ranks.values():
                    other.close()
                conn.close()
                return request
            for fd in request.fds:
                os.close(fd)
            ranks[pid] = conn
            _send_line(conn, f"pid {pid}")
        _reap(ranks)


def _reap(ranks: dict[int, socket.socket], until: float = 0.0) -> None:
    """Send each rank that ended its status; wait for the rest until `until` (`time.monotonic()`)."""
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if not pid:
            if time.monotonic() >= until:
                return
            time.sleep(0.01)
            continue
        conn = ranks.pop(pid, None)
        if conn is not None:
            _send_line(conn, f"status {status}")
            conn.close()


def _read_request(conn: socket.socket) -> Request | None:
    """The relay's request, or None (another user, a malformed or stalled request)."""
    fds: list[int] = []
    try:
        uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[2]
        conn.settimeout(_READ_TIMEOUT_S)
        header, fds, _, _ = socket.recv_fds(conn, _HEADER.size, _FDS)
        if uid != os.getuid() or len(header) != _HEADER.size or len(fds) != _FDS:
            raise ValueError("not a relay of this user")
        (size,) = _HEADER.unpack(header)
        body = b""
        while len(body) < size:
            chunk = conn.recv(min(size - len(body), 1 << 20))
            if not chunk:
                raise ValueError("short request")
            body += chunk
        identity = json.loads(body)
        conn.settimeout(None)
        return Request(fds, dict(identity["env"]), str(identity["cwd"]), list(identity["argv"]))
    except (OSError, ValueError, KeyError, TypeError):
        for fd in fds:
            os.close(fd)
        return None


def _send_line(conn: socket.socket, line: str) -> None:
    try:
        conn.sendall(line.encode() + b"\n")
    except OSError:
        pass  # the relay is gone: its lifeline ends the rank


def become(request: Request) -> Callable[[int], None]:
    """In the forked child: take the relay's identity, as a fresh `python -m zerorun.launch.worker` would have.

    Returns `note_exit(code)`, to call with the status the rank is about to exit with: the relay's witness of
    it should the zygote, which would report it, be gone by then."""
    stdin, stdout, stderr, lifeline, note = request.fds
    if select.select([lifeline], [], [], 0)[0]:  # the relay gave up waiting for this fork and made its own rank
        os._exit(1)
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for fd in (lifeline, note):
        os.set_inheritable(fd, False)  # the rank's own children hold neither (its group dies with it anyway)
    threading.Thread(target=_die_with_relay, args=(lifeline,), name="zerorun-lifeline", daemon=True).start()
    threads_before = os.environ.get("OMP_NUM_THREADS")
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    sys.argv = list(request.argv)
    _fresh_state(threads_before)

    def note_exit(code: int) -> None:
        try:
            os.write(note, f"{code}\n".encode())
        except OSError:
            pass
    return note_exit


def _fresh_state(threads_before: str | None) -> None:
    """What differs between a forked and a fresh interpreter that a script can see. `random` reseeds itself in
    a forked child; numpy's global generator and torch's CPU generator do not, and are seeded from the OS here
    wherever a fresh interpreter seeds them so."""
    import torch

    generator = sys.modules.get("numpy.random")
    if generator is not None:  # seeded from the OS at its first draw: a draw in the zygote (a library's import)
        generator.seed()  # would give every rank the same numbers, where fresh interpreters each have their own
    if torch.initial_seed() != TORCH_FIXED_SEED:  # this torch seeds its CPU generator from the OS at start: each
        torch.default_generator.seed()  # fresh rank had its own; forked ones would all share the zygote's
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads != threads_before and threads and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # torch read OpenMP's threads once, at import, in the zygote


def _die_with_relay(lifeline: int) -> None:
    try:
        while os.read(lifeline, 1):
            pass
    except OSError:
        pass
    os.killpg(os.getpgid(0), signal.SIGKILL)  # the rank and its children, as the relay's group SIGKILL took them


# ---------------------------------------------------------------------------------------------
# The relay's side


def pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when `pid` exits (Linux >= 5.3); None: poll instead."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class Rank:
    """A rank the zygote forked for this relay: its pid, and descriptors readable once it has ended.

    The zygote sends the rank's wait status. Should the zygote be gone first (killed: the rank lives on,
    its parent gone), the rank's end is seen on a pidfd and its status is what it noted on its way out,
    or a SIGKILL where it noted nothing (it was killed before its script ended)."""

    def __init__(self, conn: socket.socket, pid: int, lifeline_w: int, note_r: int, received: bytes) -> None:
        self.conn, self.pid, self._note_r = conn, pid, note_r
        self._lifeline_w = lifeline_w  # held open while this relay lives: its close ends the rank
        self._received = received
        self._zygote_gone = False
        self._pidfd = pidfd(pid)

    def exit_fds(self) -> list[int]:
        return [self.conn.fileno()] + ([self._pidfd] if self._pidfd is not None else [])

    def signal(self, sig: int) -> None:
        """Pass a signal on to the rank's process group (its own session), as torchrun's reached it when it was ours."""
        for send in (os.killpg, os.kill):  # before the rank's setsid its group is not there yet
            try:
                send(self.pid, sig)
                return
            except ProcessLookupError:
                continue
            except PermissionError:
                return

    def poll(self) -> int | None:
        """The rank's wait status once it has ended, else None."""
        status = self._from_zygote(block=False)
        if status is None and self._zygote_gone and self._ended(0.0):
            return self._noted()
        return status

    def wait(self) -> int:
        status = self._from_zygote(block=True)
        if status is not None:
            return status
        while not self._ended(0.1):
            pass
        return self._noted()

    def _from_zygote(self, block: bool) -> int | None:
        while not self._zygote_gone:
            line, newline, _ = self._received.partition(b"\n")
            if newline:
                word, _, value = line.partition(b" ")
                return int(value) if word == b"status" else signal.SIGKILL
            self.conn.setblocking(block)
            try:
                chunk = self.conn.recv(64)
            except BlockingIOError:
                return None
            finally:
                self.conn.setblocking(True)
            self._received += chunk
            self._zygote_gone = not chunk
        return None

    def _ended(self, timeout_s: float) -> bool:
        if self._pidfd is not None:
            return bool(select.select([self._pidfd], [], [], timeout_s)[0])
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(timeout_s)
        return False

    def _noted(self) -> int:
        try:
            note = os.read(self._note_r, 64).strip()
        except OSError:
            note = b""
        return int(note) << 8 if note.isdigit() else signal.SIGKILL  # a wait status: exit code << 8, or the signal


def request_rank(stdout_w: int, stderr_w: int) -> Rank | None:
    """Ask this node's zygote for the rank, with this process's identity; None: fork it yourself."""
    name = os.environ.get(ADDRESS_ENV)
    if not name or not enabled():
        return None
    lifeline_r, lifeline_w = os.pipe()
    note_r, note_w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(_FORK_TIMEOUT_S)
        conn.connect("\0" + name)
        body = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv}).encode()
        socket.send_fds(conn, [_HEADER.pack(len(body))], [0, stdout_w, stderr_w, lifeline_r, note_w])
        conn.sendall(body)
        reply = b""
        while b"\n" not in reply:
            chunk = conn.recv(64)
            if not chunk:
                raise OSError("the zygote forked nothing")
            reply += chunk
        line, _, received = reply.partition(b"\n")
        word, _, value = line.partition(b" ")
        if word != b"pid":
            raise OSError(f"unexpected reply {line!r}")
        pid = int(value)
        conn.settimeout(None)
    except (OSError, ValueError):  # a rank the zygote forks after all finds its lifeline closed, and exits
        conn.close()
        for fd in (lifeline_r, lifeline_w, note_r, note_w):
            os.close(fd)
        return None
    os.close(lifeline_r)
    os.close(note_w)
    os.set_blocking(note_r, False)
    return Rank(conn, pid, lifeline_w, note_r, received)
