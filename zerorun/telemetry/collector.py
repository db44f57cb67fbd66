"""The launcher's side of the wire: a TCP server that folds every rank's records into one `RunState`
and appends each of them to `runs/<name>/telemetry.jsonl`.

One thread serves every connection with a selector (no thread per rank). A line that is not a
JSON object with a `type` is dropped; an unfinished line when a connection closes is dropped (a
probe that lost its connection mid-send resends whole records). The JSONL file is append-only:
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

import json
import selectors
import socket
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from zerorun.telemetry.state import RunState

MAX_LINE = 1 << 20  # a longer line is not a record: the connection is dropped
_WAKE = object()  # selector data of the wake-up socket


class Collector:
    """Accepts probes on `bind_host`, advertises `advertise_host:port` for the workers' environment."""

    def __init__(self, path: Path, state: RunState | None = None, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None) -> None:
        self.path = Path(path)
        self.state = state or RunState()
        self.lock = threading.Lock()
        self.records = 0
        self.written = 0  # records that reached the file
        self.write_error: OSError | None = None  # the first error writing the file; nothing more is written
        self.sinks: list[Sink] = []  # trackers (TensorBoard, CSV, W&B, MLflow), added before start
        self.sink_errors: list[tuple[str, Exception]] = []  # (sink name, its first error): that sink is dropped
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
        except (OSError, ValueError):  # a closed selector at shutdown, a socket gone bad: serve on
            time.sleep(timeout)

    def _handle_ready(self, timeout: float) -> None:
        ready = self._selector.select(timeout)
        lines: list[bytes] = []
        for key, _ in ready:
            if key.data is None:
                self._accept_connection()
            elif key.data is _WAKE:
                continue
            else:
                lines.extend(self._read(key))
        if lines:
            now = time.time()
            with self.lock:
                for line in lines:
                    record = _parse(line)
                    if record is not None:
                        self._accept(record, line, now)
                self._flush()

    def _accept_connection(self) -> None:
        assert self._server is not None
        try:
            conn, _ = self._server.accept()
        except OSError:
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, data=bytearray())

    def _read(self, key: selectors.SelectorKey) -> list[bytes]:
        conn: socket.socket = key.fileobj  # type: ignore[assignment]
        pending: bytearray = key.data
        try:
            chunk = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError:
            chunk = b""
        if not chunk:  # closed: an unfinished line is dropped
            self._selector.unregister(conn)
            conn.close()
            return []
        pending += chunk
        *lines, rest = bytes(pending).split(b"\n")
        pending[:] = rest
        if len(pending) > MAX_LINE:
            self._selector.unregister(conn)
            conn.close()
        return [line for line in lines if line.strip()]

    # -- under the lock --------------------------------------------------------------------------

    def _accept(self, record: dict[str, Any], line: bytes, now: float) -> None:
        self.state.ingest(record, now)
        self.records += 1
        if self._file is not None:
            try:
                self._file.write(line.strip() + b"\n")
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
    directory: Path

    def add(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def _parse(line: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("type"), str):
        return None
    return record
