"""The engines alive in this process: whom a clip call over their parameters goes to, and whose collectives
still in flight are finished before the process group goes (`settle_all`).

An engine enters when it is built and leaves at `engine.destroy()` (or when it is garbage-collected): a
set of weak references, so the set never keeps an engine alive.
"""

from __future__ import annotations

import weakref
from typing import Any

_live: weakref.WeakSet[Any] = weakref.WeakSet()


def enter(engine: Any) -> None:
    _live.add(engine)


def leave(engine: Any) -> None:
    """`engine` leaves (None: it was garbage-collected, and left the set then)."""
    if engine is not None:
        _live.discard(engine)


def live() -> list[Any]:
    """The live engines, in no particular order."""
    return list(_live)


def settle_all() -> None:
    """Finish the collectives every live engine of this process still has in flight. The worker calls it when the
    script ends (and before a script's own `destroy_process_group()`): after the last `step()` a deferred
    publish or a prefetch may still be on the wire, and gloo aborts a process whose group is torn down
    under a running collective ("terminate called without an active exception")."""
    for engine in live():
        engine.store.settle()
