"""What the runtime keeps while engines live, in one object: a `Runtime` per process, or per rank where ranks are
threads of one process (tests/rank_threads.py).

    runtime = context.current()         # this thread's runtime, made on its first use
    engine.runtime                      # the one the engine was built in; what the engine builds is handed it
    with context.using(Runtime()):      # a runtime of its own for what runs inside, closed after

| held                                   | by whom                                                          |
|----------------------------------------|------------------------------------------------------------------|
| `events`: the step, checkpoint and setup listeners | the telemetry probe, a profile window, tests; the engine and its checkpointer emit |
| `ranges`: whether phases are named in a profiler trace | a profile window switches it; the engine's parts name their ranges |
| `engines`: the live engines, oldest first | a routed clip call, `settle_all` and the worker's last meeting (interop/) |
| `recipe`: the recipe this worker was launched with | `zerorun.recipe()` |
| parts of a subpackage, one of each kind, made on first use (`part(Kind)`) | checkpoint/background.py's saves in flight, comm/shm_collectives.py's segments (one per process group), stage3/sharded_init.py's logs, telemetry/profile.py's open window |

Nothing of this lives in a module's globals (tests/test_runtime_state.py refuses mutable module-level state in
zerorun/runtime/), so two engines in one process share only what they were built in: a rank thread's engines and
its peers' never meet, and a test's reference engine can be built in a runtime of its own. `current()` is a context
variable: a thread starts without a runtime and makes its own on first use. The threads an engine starts (its
shared-memory, codec and overlap workers) never look the runtime up; they are handed what they need.

What stays per process, because it is so by nature: torch's attributes an engine patches (interop/patches.py
counts their holders), the kernels a process has loaded (zerorun/ops.py), the telemetry probe of a worker.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from zerorun.runtime.events import Events
from zerorun.runtime.ranges import Ranges

if TYPE_CHECKING:
    from zerorun.config import Recipe

__all__ = ["LiveEngines", "Runtime", "current", "existing", "using"]


P = TypeVar("P")  # a subpackage's state in a runtime: made with no arguments, closed with it (`close()`, if it has one)


class LiveEngines:
    """The engines alive in a runtime, in the order they were built (the same on every rank). Weak references: the
    set never keeps an engine alive. An engine enters when it is built and leaves at `destroy()` or when it is
    garbage-collected."""

    def __init__(self) -> None:
        self._order: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._built = itertools.count()

    def enter(self, engine: Any) -> None:
        self._order.setdefault(engine, next(self._built))

    def leave(self, engine: Any) -> None:
        """`engine` leaves (None: it was garbage-collected, and left then)."""
        if engine is not None:
            self._order.pop(engine, None)

    def stepping_an_optimizer(self) -> bool:
        """Whether a live engine is stepping a script's optimizer right now (no ordering: on every collective)."""
        return any(engine.update.is_stepping() for engine in list(self._order.keys()))

    def live(self) -> list[Any]:
        """The live engines, oldest first."""
        return sorted(self._order.keys(), key=lambda engine: self._order.get(engine, 0))

    def settle_all(self) -> None:
        """Finish the collectives every live engine still has in flight. The worker calls it when the script ends (and
        before a script's own `destroy_process_group()`): after the last `step()` a deferred publish or a prefetch may
        still be on the wire, and gloo aborts a process whose group is torn down under a running collective
        ("terminate called without an active exception")."""
        for engine in self.live():
            engine.store.settle()

    def end_of_script(self) -> bool:
        """The worker's last meeting, through the newest live engine's collectives: a rank still training meets it and
        stops, naming the ranks whose scripts ended (a data loader that ran out on one rank). False: none lives."""
        engines = self.live()
        if not engines:
            return False
        engines[-1].comm.end_of_script()
        return True


class Runtime:
    """The state of one process's (or one rank thread's) engines: see the module's table."""

    def __init__(self, recipe: Recipe | None = None) -> None:
        self.events = Events()
        self.ranges = Ranges()
        self.engines = LiveEngines()
        self.recipe = recipe
        self._parts: dict[type, Any] = {}

    def part(self, kind: type[P]) -> P:
        """This runtime's `kind` (made on first use): a subpackage keeps its state here without the runtime knowing it."""
        if kind not in self._parts:
            self._parts[kind] = kind()
        return self._parts[kind]  # type: ignore[no-any-return]

    def close(self) -> None:
        """Let go of what the parts hold (a shared-memory segment per group, ...). The runtime may be used again."""
        parts, self._parts = self._parts, {}
        for state in parts.values():
            closing = getattr(state, "close", None)
            if closing is not None:
                closing()


_current: contextvars.ContextVar[Runtime] = contextvars.ContextVar("zerorun_runtime")


def existing() -> Runtime | None:
    """This thread's runtime if it has one (a lookup that makes none: for what runs on every collective)."""
    return _current.get(None)


def current() -> Runtime:
    """This thread's runtime (made on its first use): where an engine built here lives."""
    try:
        return _current.get()
    except LookupError:
        runtime = Runtime()
        _current.set(runtime)
        return runtime


@contextlib.contextmanager
def using(runtime: Runtime, close: bool = True) -> Iterator[Runtime]:
    """`runtime` is current inside (this thread's, and what it built keeps it after); closed after unless `close` is
    False."""
    token = _current.set(runtime)
    try:
        yield runtime
    finally:
        _current.reset(token)
        if close:
            runtime.close()
