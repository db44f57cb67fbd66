"""One thread reads the output of every node of a job, however many there are.

The supervisor holds two pipes per node (the node supervisor's stdout and stderr, locally or
through ssh) for the job's whole life. A reader thread per pipe meant two threads per host: 4,000
threads for a job of 2,000 hosts. Instead one thread waits on every pipe with a selector, splits
what arrives into lines, notes that the node was heard from (its heartbeats arrive the same way)
and puts `(node index, fd, line)` on the supervisor's queue; `(node index, fd, None)` when the pipe
closed. A line longer than `MAX_LINE` is passed on in pieces of that size, so a node printing
without newlines cannot fill the launcher's memory.
"""

from __future__ import annotations

import os
import queue
import selectors
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Generic, TypeVar

MAX_LINE = 1 << 20
_READ_SIZE = 1 << 16

Event = tuple[int, int, "bytes | None"]
Item = TypeVar("Item")


class Intake(Generic[Item]):
    """What other threads hand a selector thread, and the socket that wakes it (register `socket`)."""

    def __init__(self) -> None:
        self.socket, self._wake_w = socket.socketpair()
        self.socket.setblocking(False)
        self._wake_w.setblocking(False)
        self._items: list[Item] = []
        self._lock = threading.Lock()

    def put(self, item: Item) -> None:
        with self._lock:
            self._items.append(item)
        self.wake()

    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # BlockingIOError: wake-ups are already waiting; OSError: closed
            pass

    def take(self) -> list[Item]:
        """Everything put since the last call (the selector thread, when `socket` is readable)."""
        try:
            while self.socket.recv(4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            items, self._items = self._items, []
        return items

    def close(self) -> None:
        self.socket.close()
        self._wake_w.close()


@dataclass
class _Pipe:
    node_index: int
    fd: int  # 1 or 2: which of the node's streams
    stream: IO[bytes]
    pending: bytearray = field(default_factory=bytearray)


class OutputReader:
    """Reads node pipes added with `add` on one background thread, until each closes or `close()`."""

    def __init__(self, events: queue.Queue[Event], heard: Callable[[int], None]) -> None:
        self._events = events
        self._heard = heard  # called with the node index whenever bytes arrive from it
        self._selector = selectors.DefaultSelector()
        self._intake: Intake[_Pipe] = Intake()
        self._selector.register(self._intake.socket, selectors.EVENT_READ, data=None)
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="zerorun-node-output", daemon=True)
        self._thread.start()

    def add(self, node_index: int, fd: int, stream: IO[bytes]) -> None:
        """Read `stream` (a pipe) from now on; its lines come as events of `node_index` and `fd`."""
        os.set_blocking(stream.fileno(), False)
        self._intake.put(_Pipe(node_index, fd, stream))

    def close(self, timeout: float = 2.0) -> None:
        """Stop reading: the pipes still open are closed (their nodes were stopped before)."""
        self._closing = True
        self._intake.wake()
        self._thread.join(timeout)

    def _serve(self) -> None:
        try:
            while not self._closing:
                for key, _ in self._selector.select():
                    if key.data is None:
                        self._take_added()
                    else:
                        self._read(key.data)
        finally:
            for key in list(self._selector.get_map().values()):
                if key.data is not None:
                    key.data.stream.close()
            self._selector.close()
            self._intake.close()

    def _take_added(self) -> None:
        for pipe in self._intake.take():
            self._selector.register(pipe.stream.fileno(), selectors.EVENT_READ, data=pipe)

    def _read(self, pipe: _Pipe) -> None:
        try:
            data = os.read(pipe.stream.fileno(), _READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the pipe closed: what is left is its last line
            if pipe.pending:
                self._events.put((pipe.node_index, pipe.fd, bytes(pipe.pending)))
            self._events.put((pipe.node_index, pipe.fd, None))
            self._selector.unregister(pipe.stream.fileno())
            pipe.stream.close()
            return
        self._heard(pipe.node_index)
        pipe.pending += data
        start = 0
        while (end := pipe.pending.find(b"\n", start)) >= 0:
            self._events.put((pipe.node_index, pipe.fd, bytes(pipe.pending[start:end])))
            start = end + 1
        del pipe.pending[:start]
        while len(pipe.pending) >= MAX_LINE:
            self._events.put((pipe.node_index, pipe.fd, bytes(pipe.pending[:MAX_LINE])))
            del pipe.pending[:MAX_LINE]
