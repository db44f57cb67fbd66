"""The one interface every tracker has, and the thread that keeps a slow one off the collector's.

A tracker gets every telemetry record, as parsed (`add`), and `close` at the end of the job. The
collector calls both on its own thread, so a tracker that talks to a service (W&B, MLflow) runs
behind `Background`: `add` only queues the record, a thread of the tracker's own logs it, and a
tracker that fails (no network, bad credentials, a full disk) stops there and raises its first
error from `close`, which the collector turns into one warning. Never the job's exit code.
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any, Callable, Protocol

QUEUE_RECORDS = 100_000  # records waiting for a slow service; past this they are dropped and counted
CLOSE_TIMEOUT_S = 60.0  # how long the end of a job waits for a tracker to send what it queued


class Tracker(Protocol):
    """Another place telemetry goes, written by the launcher from the stream."""

    name: str
    directory: Path | str  # where it writes: a folder, or a service's address

    def add(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class TrackerUnavailable(Exception):
    """A tracker the recipe asks for cannot start (its library is missing, its service refused)."""


class Background:
    """Runs a tracker made by `open_tracker` on a thread of its own, records fed through a queue."""

    def __init__(self, name: str, directory: Path | str, open_tracker: Callable[[], Tracker]) -> None:
        self.name = name
        self.directory = directory
        self.dropped = 0
        self._open = open_tracker
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(QUEUE_RECORDS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"zerorun-tracker-{name}", daemon=True)
        self._thread.start()

    def add(self, record: dict[str, Any]) -> None:
        if self._error is not None:
            self._queue.put_nowait(None)  # the thread ends: the collector drops this tracker and warns once
            raise self._error
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        try:
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        except queue.Full:
            pass
        self._thread.join(CLOSE_TIMEOUT_S)
        if self._thread.is_alive():
            raise TimeoutError(f"{self.name} did not finish sending in {CLOSE_TIMEOUT_S:.0f} s; the rest is lost")
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        try:
            tracker = self._open()
            self.directory = tracker.directory
        except BaseException as exc:  # noqa: BLE001 - reported from add/close, as one warning
            self._error = exc
            self._drain()
            return
        try:
            while (record := self._queue.get()) is not None:
                tracker.add(record)
        except BaseException as exc:  # noqa: BLE001
            self._error = exc
            self._drain()
        try:
            tracker.close()
        except BaseException as exc:  # noqa: BLE001
            self._error = self._error or exc

    def _drain(self) -> None:
        """Take what is queued (and what comes until close) so that neither add nor close blocks."""
        while self._queue.get() is not None:
            pass
