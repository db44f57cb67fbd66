"""What a collective returns: a `Handle` to wait on, its follow-up run once; `Pending` work of several; and the
byte, call and time counts every collective keeps (`CommStats`).

Time is measured from launch to the end of `wait()` on the host, so accounting never adds a
synchronisation of its own.
"""

from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class CommStats:
    """Bytes, calls and host-side seconds per collective kind (all ranks report their own)."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # in flight: launch to wait()
    # blocked inside wait(): the communication compute did not hide (on CUDA the host rarely blocks: a lower bound)
    waited: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # where the bytes go: "node" (shared memory, never leaving the host) or "network" (the backend's transport:
    # across nodes, the link); reported as <level>_bytes beside each kind's total. `level` is where this group's
    # flat collectives go; hierarchical ones (hier_collectives.py) count each level's share
    level: str = "network"
    by_level: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(int)))

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {kind: {"bytes": self.bytes[kind], "calls": self.calls[kind], "seconds": self.seconds[kind],
                       "waited": self.waited[kind], **{f"{lvl}_bytes": n for lvl, n in self.by_level[kind].items()}}
                for kind in self.calls}

    def level_bytes(self) -> dict[str, int]:
        """Bytes per level, every kind together."""
        total: dict[str, int] = defaultdict(int)
        for levels in self.by_level.values():
            for lvl, n in levels.items():
                total[lvl] += n
        return dict(total)


class Handle:
    """Pending collective work; `wait()` finishes it and runs the follow-up, exactly once."""

    def __init__(self, works: list, then: Callable[[], object] | None, stats: CommStats, kind: str) -> None:
        self._works = works
        self._then = then
        self._stats = stats
        self._kind = kind
        self._started = time.perf_counter()
        self.done = False

    @property
    def ready(self) -> bool:
        """The transfer has finished (`wait()` would not block on it; its follow-up may still be due)."""
        return all(work is None or work.is_completed() for work in self._works)

    def is_completed(self) -> bool:
        """`ready`, as a process-group work says it (a handle can be another's work)."""
        return self.ready

    def wait(self) -> None:
        if self.done:
            return
        blocked = time.perf_counter()
        for work in self._works:
            if work is not None:
                work.wait()
        self._stats.waited[self._kind] += time.perf_counter() - blocked
        if self._then is not None:
            self._then()
        self._stats.seconds[self._kind] += time.perf_counter() - self._started
        self.done = True

    def followed_by(self, then: Callable[[], object]) -> Handle:
        """This handle's work with `then` run after its own follow-up (one handle: its time counted once)."""
        first = self._then

        def both() -> None:
            if first is not None:
                first()
            then()
        chained = Handle(self._works, both, self._stats, self._kind)
        chained._started = self._started
        return chained


class Pending:
    """Work started now and finished by `wait()`: its collectives, then what must follow them, once.

    Stores return one from `publish()`; with `zero.overlap_publish` stages 1/2 wait later, just before the
    first module that reads each unit (deferred_publish.py).
    """

    def __init__(self, handles: list[Handle] | None = None, then: Callable[[], object] | None = None) -> None:
        self.handles = handles or []
        self._then = then
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        for handle in self.handles:
            handle.wait()
        if self._then is not None:
            self._then()
        self.done = True


class FutureWork:
    """Work on a worker thread (the levels here, a shared-memory operation), seen as a process-group work."""

    def __init__(self, future: Future) -> None:
        self.future = future

    def wait(self) -> None:
        self.future.result()  # re-raises its error (a peer gone, the timeout) here

    def is_completed(self) -> bool:
        return self.future.done()
