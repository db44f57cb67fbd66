"""The link between a node's launcher and node 0's, when every node runs its own: one TCP connection,
proven both ways with the job's secret, carrying frames.

Over SSH the launcher's side of a node is a pipe to `ssh`; here it is this link, and it carries the
same things: the node's output lines and its exit status one way, stop/kill orders and heartbeats
the other. Node 0's launcher listens on the port after the rendezvous'; every other node's
launcher connects (retrying while node 0 is not up yet) and joins.

**Proof, both ways.** Node 0 sends a greeting with a random challenge; the joining launcher answers
with HMAC-SHA256(secret, "member:" + challenge) and a challenge of its own; node 0 checks it and
answers HMAC-SHA256(secret, "node0:" + that challenge). Neither side reads anything else before its
peer has proven the secret (`PROVE_S`, lines of at most `MAX_PROOF_LINE` bytes), and the prefixes keep
one side's proof from being replayed as the other's. The secret never crosses the wire. Nothing is
encrypted: the frames carry the workers' output and orders (the same trust as torch's own
rendezvous and collectives, which run in the clear); keep the nodes on a private network.

**Frames**: a kind byte, a 4-byte big-endian length, the payload (at most `MAX_PAYLOAD`: a longer
one, or an unknown kind, closes the link).
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import json
import secrets
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

from zerorun.errors import LaunchError
from zerorun.telemetry.records import prove

HEADER = struct.Struct("!cI")
MAX_PAYLOAD = 2 << 20  # a node's line is at most 1 MiB (node_output.MAX_LINE); JSON messages are small
MAX_PROOF_LINE = 256
PROVE_S = 5.0
SEND_TIMEOUT_S = 5.0  # a peer that takes nothing for this long is gone
CONNECT_TIMEOUT_S = 5.0
GREETING = b"zerorun-link/1"
_READ_SIZE = 1 << 16


class Kind(enum.Enum):
    """What a frame is."""

    HELLO = b"H"  # a joining launcher -> node 0: who it is (JSON)
    OUT = b"O"  # -> node 0: bytes of its node's stdout (whole lines)
    ERR = b"E"  # -> node 0: bytes of its node's stderr (whole lines, heartbeat records included)
    EXIT = b"X"  # -> node 0: its node supervisor's exit status (text)
    ATTEMPT = b"A"  # node 0 -> a node: run this attempt (JSON)
    STOP = b"S"  # node 0 -> a node: stop the attempt
    KILL = b"K"  # node 0 -> a node: kill it now (a second Ctrl-C)
    BEAT = b"B"  # both ways, every second, so that each side tells a quiet link from a lost one
    END = b"N"  # node 0 -> a node: the job is over; exit with this status (text)
    REFUSE = b"R"  # node 0 -> a node: not admitted, and why (text)


Frame = tuple[Kind, bytes]
_KINDS = {kind.value: kind for kind in Kind}


class LinkError(LaunchError):
    """The link could not be made or broke its protocol; the message says which side and why."""


@dataclass(frozen=True)
class Hello:
    """Who a joining launcher is: node 0 admits it only if it runs the same job the same way."""

    node_rank: int
    nnodes: int
    host: str  # its host name: the `[host:rank]` prefixes, and how teardown tells its processes
    nproc: int  # its workers
    recipe: str  # the digest of its resolved recipe (`peer_launch.recipe_digest`)
    versions: dict[str, str]  # python, torch, zerorun

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, payload: bytes) -> Hello:
        return cls(**_fields(cls, payload))


@dataclass(frozen=True)
class Attempt:
    """What node 0 tells each node to run: every node plans the attempt itself from this and its own recipe."""

    job_id: str
    node_index: int  # this node's place in the attempt (its torchrun --node-rank)
    nodes: list[tuple[str, int]]  # every node of the attempt: host, workers
    master_port: int
    micro_batch_size: int  # the batch shape (a shrunken restart raises the accumulation)
    grad_accum_steps: int
    telemetry: str | None  # the collector's host:port, None without telemetry

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, payload: bytes) -> Attempt:
        fields = _fields(cls, payload)
        return cls(**{**fields, "nodes": [(str(host), int(nproc)) for host, nproc in fields["nodes"]]})


def _fields(cls: type, payload: bytes) -> dict[str, Any]:
    """The message's fields, exactly the dataclass's; LinkError if it is something else."""
    try:
        data = json.loads(payload)
    except ValueError:
        data = None
    names = {field.name for field in dataclasses.fields(cls)}
    if not isinstance(data, dict) or set(data) != names:
        raise LinkError(f"a {cls.__name__.lower()} message of another shape (another zerorun version?)")
    return data


class Frames:
    """Frames out of a byte stream, fed as it arrives."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames: list[Frame] = []
        while len(self._buffer) >= HEADER.size:
            code, length = HEADER.unpack_from(self._buffer)
            if code not in _KINDS or length > MAX_PAYLOAD:
                raise LinkError(f"not a zerorun link frame (kind {code!r}, {length} bytes)")
            if len(self._buffer) < HEADER.size + length:
                break
            frames.append((_KINDS[code], bytes(self._buffer[HEADER.size:HEADER.size + length])))
            del self._buffer[:HEADER.size + length]
        return frames


class Link:
    """One proven connection: whole frames sent under a lock (any thread), frames read as they come."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer  # host:port, for messages
        self.closed = False
        self.last_heard = time.monotonic()
        self._frames = Frames()
        self._send_lock = threading.Lock()
        sock.settimeout(SEND_TIMEOUT_S)

    def send(self, kind: Kind, payload: bytes = b"") -> bool:
        """Send one frame; False (and the link closed) when the peer is gone or takes nothing."""
        if self.closed:
            return False
        try:
            with self._send_lock:
                self.sock.sendall(HEADER.pack(kind.value, len(payload)) + payload)
            return True
        except OSError:  # socket.timeout included: a frame half sent leaves the stream unusable
            self.close()
            return False

    def read_ready(self) -> list[Frame]:
        """The frames in what the socket holds now (call when it is readable); closes the link at its end."""
        try:
            data = self.sock.recv(_READ_SIZE)
        except (BlockingIOError, InterruptedError, socket.timeout):
            return []
        except OSError:
            data = b""
        if not data:
            self.close()
            return []
        self.last_heard = time.monotonic()
        try:
            return self._frames.feed(data)
        except LinkError:
            self.close()
            return []

    def receive(self, timeout: float) -> list[Frame]:
        """Wait up to `timeout` for frames (the joining launcher's loop)."""
        if self.closed:
            return []
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout)
        except (OSError, ValueError):
            self.close()
            return []
        return self.read_ready() if ready else []

    def silent_s(self) -> float:
        return time.monotonic() - self.last_heard

    def close(self) -> None:
        """End the connection (any thread): the side that reads it sees its end and `release`s it."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def finish(self, timeout_s: float = 2.0) -> None:
        """Close once the peer has read what was sent (its end comes first): closing over bytes of its that were
        never read would reset the connection, and the peer might lose the last frame."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                if not select.select([self.sock], [], [], remaining)[0] or not self.sock.recv(_READ_SIZE):
                    break
            except (OSError, ValueError):
                break
        self.release()

    def release(self) -> None:
        """Free the socket (the thread that reads it, once it has stopped reading)."""
        self.close()
        self.sock.close()


def admit(sock: socket.socket, secret: str) -> None:
    """Node 0's side of the proof: the peer proves the secret, then node 0 proves it back; LinkError if not."""
    deadline = time.monotonic() + PROVE_S
    challenge = secrets.token_hex(16)
    _send_line(sock, GREETING + b" " + challenge.encode(), deadline)
    answer = _read_line(sock, deadline).split()
    if len(answer) != 2 or not hmac.compare_digest(answer[0], prove(secret, "member:" + challenge)):
        raise LinkError("it did not prove the job's secret")
    _send_line(sock, prove(secret, "node0:" + answer[1]).encode(), deadline)


def join(sock: socket.socket, secret: str, where: str) -> None:
    """A joining launcher's side of the proof; LinkError naming node 0's address if it fails."""
    deadline = time.monotonic() + PROVE_S
    greeting = _read_line(sock, deadline, where).split()
    if len(greeting) != 2 or greeting[0] != GREETING.decode():
        raise LinkError(f"{where} is not a zerorun launcher (it said {' '.join(greeting)[:60]!r}).")
    challenge = secrets.token_hex(16)
    _send_line(sock, f"{prove(secret, 'member:' + greeting[1])} {challenge}".encode(), deadline)
    try:
        answer = _read_line(sock, deadline, where)
    except LinkError:
        raise LinkError(f"node 0's launcher at {where} closed the connection: it did not take this node's proof. "
                        "Is ZERORUN_JOB_SECRET the same on every node?") from None
    if not hmac.compare_digest(answer, prove(secret, "node0:" + challenge)):
        raise LinkError(f"{where} did not prove the job's secret: not this job's node 0.")


def connect(host: str, port: int, deadline: float) -> socket.socket | None:
    """A TCP connection to node 0's launcher, or None if it cannot be made (yet) before `deadline`."""
    try:
        return socket.create_connection((host, port), timeout=max(0.1, min(CONNECT_TIMEOUT_S,
                                                                         deadline - time.monotonic())))
    except OSError:
        return None


def _send_line(sock: socket.socket, line: bytes, deadline: float) -> None:
    sock.settimeout(max(0.01, deadline - time.monotonic()))
    try:
        sock.sendall(line + b"\n")
    except OSError as exc:
        raise LinkError(f"the connection broke during the proof ({exc.strerror or exc})") from None


def _read_line(sock: socket.socket, deadline: float, where: str = "the peer") -> str:
    """One line of the proof, read a byte at a time (frames follow it), bounded in size and time."""
    line = bytearray()
    while not line.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or len(line) > MAX_PROOF_LINE:
            raise LinkError(f"{where} did not complete the proof within {PROVE_S:g} s")
        sock.settimeout(remaining)
        try:
            byte = sock.recv(1)
        except OSError:
            byte = b""
        if not byte:
            raise LinkError(f"{where} closed the connection during the proof")
        line += byte
    return line.decode("ascii", "replace").strip()
