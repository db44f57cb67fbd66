"""The launcher's side of the wire: a TCP server that folds every rank's records into one `RunState`
and appends each of them to `runs/<name>/telemetry.jsonl`.

One thread serves every connection with a selector (no thread per rank). Hostile input:
- **Authentication.** Given the job's `token` (random per job, handed to workers in their
  environment, never on a command line), the collector sends each new connection a random
  challenge and reads nothing from it until its first line is the HMAC-SHA256 of that challenge
  under the token (`prove`); a wrong or late answer closes the connection. At most
  `MAX_UNPROVEN` connections may be waiting to prove themselves, for `PROVE_S` each, with at most
  `MAX_PROOF_LINE` bytes; at most `MAX_CONNECTIONS` in all.
- **Records** are checked against `records.SCHEMAS` (types, ranks within the world, bounded
  sizes); a connection speaks for the rank of its first record only. A record that fails is
  dropped and counted (`rejected`, the first reason in `rejected_reason`): the monitor warns
  once; nothing a worker sends can stop this thread. A line over `MAX_LINE` closes its connection.
  An unfinished line when a connection closes is dropped (a probe that lost its connection
  mid-send resends whole records).
- Each record is written with the job id it came under (`job_id`), so the file never mixes jobs. The JSONL file is append-only:
the launcher writes a `job` record first and an `end` record last, so several runs of the same
name follow one another in one file and `zerorun report` shows the last one.

`lock` guards `state` and the file: the console reads the state under it.

Telemetry never decides how a job ends: a file that cannot be written (a full disk under `runs/`)
stops the writing, not the collector. The first OSError is kept in `write_error`, with the count
of records that did not reach the file (`unwritten`); the monitor turns it into one warning. The
live view and the summary go on from memory. Sinks (TensorBoard, CSV) get each record too, under
the same rule: the first error of a sink is kept and the sink is dropped.
"""

from __future__ import annotations

import hmac
import json
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from zerorun.telemetry import records
from zerorun.telemetry.records import prove
from zerorun.telemetry.state import RunState

MAX_LINE = 1 << 20  # a longer line is not a record: the connection is dropped
MAX_CONNECTIONS = 4096  # a worker holds one (two while it reconnects)
MAX_UNPROVEN = 64  # connections not yet authenticated
MAX_PROOF_LINE = 256  # bytes an unauthenticated connection may send
PROVE_S = 5.0  # seconds a new connection has to prove the token
_WAKE = object()  # selector data of the wake-up socket


@dataclass
class _Peer:
    """One connection: what it sent so far, whether it proved the token, which rank it speaks for."""

    challenge: str
    opened_at: float
    proven: bool = False
    rank: int | None = None
    pending: bytearray = field(default_factory=bytearray)


class Collector:
    """Accepts probes on `bind_host`, advertises `advertise_host:port` for the workers' environment."""

    def __init__(self, path: Path, state: RunState | None = None, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, token: str | None = None, job_id: str | None = None) -> None:
        self.path = Path(path)
        self.state = state or RunState()
        self.lock = threading.Lock()
        self.records = 0
        self.written = 0  # records that reached the file
        self.write_error: OSError | None = None  # the first error writing the file; nothing more is written
        self.sinks: list[Sink] = []  # trackers (TensorBoard, CSV, W&B, MLflow), added before start
        self.sink_errors: list[tuple[str, Exception]] = []  # (sink name, its first error): that sink is dropped
        self.token = token  # None: no authentication (tests that speak the protocol by hand)
        self.job_id = job_id  # stamped on every worker record (a restart changes it)
        self.rejected = 0  # worker records dropped: bad schema, or another rank than the connection's
        self.rejected_reason = ""  # the first one's
        self.refused = 0  # connections closed before proving the token
        self._bind_host = bind_host
        self._advertise_host = advertise_host or bind_host
        self._selector = selectors.DefaultSelector()
        self._server: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()  # close() wakes the selector at once
        self._file: Any = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zerorun-collector", daemon=True)

    def start(self) -> str:
        """Listen and start serving; returns the `host:port` workers connect to."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed in close()
        self._server = socket.create_server((self._bind_host, 0))
        self._server.setblocking(False)
        self._selector.register(self._server, selectors.EVENT_READ, data=None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, data=_WAKE)
        self._thread.start()
        return f"{self._advertise_host}:{self._server.getsockname()[1]}"

    def record(self, record: dict[str, Any]) -> None:
        """Add one of the launcher's own records (job, stall, end)."""
        if self.job_id is not None:
            record.setdefault("job_id", self.job_id)
        line = json.dumps(record, separators=(",", ":")).encode()
        with self.lock:
            self._accept(record, line, time.time())
            self._flush()

    def close(self) -> None:
        """Stop serving (reading what already arrived first) and close the file."""
        self._closed.set()
        self._wake_w.send(b"x")
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        with self.lock:
            if self._file is not None:
                try:
                    self._file.close()  # flushes: may fail on a full disk
                except OSError as exc:
                    self._failed(exc)
                self._file = None
            for sink in list(self.sinks):
                self._to_sink(sink, sink.close)

    @property
    def unwritten(self) -> int:
        """Records that never reached the file (after a write error)."""
        return self.records - self.written

    # -- serving thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._closed.is_set():
            self._serve_once(0.2)
        self._serve_once(0.0)  # what arrived just before close

    def _serve_once(self, timeout: float) -> None:
        try:
            self._handle_ready(timeout)
            self._close_slow_provers(time.monotonic())
        except (OSError, ValueError):  # a closed selector at shutdown, a socket gone bad: serve on
            time.sleep(timeout)
        except Exception:  # noqa: BLE001 - nothing a peer sends may stop the collector
            time.sleep(timeout)

    def _handle_ready(self, timeout: float) -> None:
        ready = self._selector.select(timeout)
        lines: list[tuple[_Peer, bytes]] = []
        for key, _ in ready:
            if key.data is None:
                self._accept_connection()
            elif key.data is _WAKE:
                continue
            else:
                lines.extend((key.data, line) for line in self._read(key))
        if lines:
            now = time.time()
            with self.lock:
                for peer, line in lines:
                    record = self._check(peer, line)
                    if record is not None:
                        self._accept(record, None, now)
                self._flush()

    def _accept_connection(self) -> None:
        assert self._server is not None
        try:
            conn, _ = self._server.accept()
        except OSError:
            return
        peers = [key.data for key in self._selector.get_map().values() if isinstance(key.data, _Peer)]
        if len(peers) >= MAX_CONNECTIONS or sum(not p.proven for p in peers) >= MAX_UNPROVEN:
            self.refused += 1
            conn.close()
            return
        conn.setblocking(False)
        peer = _Peer(secrets.token_hex(16), time.monotonic(), proven=self.token is None)
        if self.token is not None:
            try:
                conn.send(json.dumps({"challenge": peer.challenge}).encode() + b"\n")  # a new socket's buffer is empty
            except OSError:
                conn.close()
                return
        self._selector.register(conn, selectors.EVENT_READ, data=peer)

    def _read(self, key: selectors.SelectorKey) -> list[bytes]:
        conn: socket.socket = key.fileobj  # type: ignore[assignment]
        peer: _Peer = key.data
        try:
            chunk = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            chunk = b""
        if not chunk:  # closed: an unfinished line is dropped
            self._drop(conn)
            return []
        peer.pending += chunk
        if not peer.proven:
            line, newline, rest = bytes(peer.pending).partition(b"\n")
            if not newline:
                if len(peer.pending) > MAX_PROOF_LINE:
                    self._refuse(conn)
                return []
            if not self._proof_ok(peer, line):
                self._refuse(conn)
                return []
            peer.proven, peer.pending[:] = True, rest
        *lines, rest = bytes(peer.pending).split(b"\n")
        peer.pending[:] = rest
        if len(peer.pending) > MAX_LINE:
            self._drop(conn)
        return [line for line in lines if line.strip()]

    def _proof_ok(self, peer: _Peer, line: bytes) -> bool:
        assert self.token is not None
        try:
            answer = json.loads(line).get("auth")
        except (ValueError, AttributeError):
            return False
        return isinstance(answer, str) and hmac.compare_digest(answer, prove(self.token, peer.challenge))

    def _close_slow_provers(self, now: float) -> None:
        for key in list(self._selector.get_map().values()):
            if isinstance(key.data, _Peer) and not key.data.proven and now - key.data.opened_at > PROVE_S:
                self._refuse(key.fileobj)  # type: ignore[arg-type]

    def _refuse(self, conn: socket.socket) -> None:
        self.refused += 1
        self._drop(conn)

    def _drop(self, conn: socket.socket) -> None:
        self._selector.unregister(conn)
        conn.close()

    def _check(self, peer: _Peer, line: bytes) -> dict[str, Any] | None:
        """The record on `line` if it may be read: valid JSON, its schema, the connection's own rank."""
        try:
            record = json.loads(line)
        except ValueError:
            self._reject("not JSON")
            return None
        problem = records.check(record, self.state.job.get("world_size"))
        if problem:
            self._reject(problem)
            return None
        if peer.rank is None:
            peer.rank = record["rank"]
        elif record["rank"] != peer.rank:
            self._reject(f"rank {record['rank']} on the connection of rank {peer.rank}")
            return None
        if self.job_id is not None:
            record["job_id"] = self.job_id
        return record

    def _reject(self, why: str) -> None:
        self.rejected += 1
        self.rejected_reason = self.rejected_reason or why
        return None

    # -- under the lock --------------------------------------------------------------------------

    def _accept(self, record: dict[str, Any], line: bytes | None, now: float) -> None:
        self.state.ingest(record, now)
        self.records += 1
        if self._file is not None:
            try:
                self._file.write((line or json.dumps(record, separators=(",", ":")).encode()) + b"\n")
                self.written += 1
            except OSError as exc:  # a full disk must not take the launcher down; the live view goes on
                self._failed(exc)
        for sink in list(self.sinks):
            self._to_sink(sink, lambda: sink.add(record))

    def _flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        """Stop writing the file after its first error (what the buffer held is lost with it)."""
        if self.write_error is None:
            self.write_error = exc
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None

    def _to_sink(self, sink: Sink, call: Any) -> None:
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - a sink's failure is reported once, never raised
            self.sinks.remove(sink)
            self.sink_errors.append((sink.name, exc))


class Sink(Protocol):
    """Another place records go, written from the collector's thread (`zerorun.telemetry.trackers`)."""

    name: str
    directory: Path | str  # a folder, or a service's address (MLflow)

    def add(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...

