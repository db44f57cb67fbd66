"""The engines alive in this process: whom a clip call over their parameters goes to, and whose collectives
still in flight are finished before the process group goes (`settle_all`).

An engine enters when it is built and leaves at `engine.destroy()` (or when it is garbage-collected): weak
references, so the set never keeps an engine alive. They are kept in the order they were built, which is the same
on every rank (the worker's last meeting goes through the newest: `end_of_script`).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

_live: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_built = itertools.count()


def enter(engine: Any) -> None:
    _live.setdefault(engine, next(_built))


def leave(engine: Any) -> None:
    """`engine` leaves (None: it was garbage-collected, and left the set then)."""
    if engine is not None:
        _live.pop(engine, None)


def live() -> list[Any]:
    """The live engines, oldest first."""
    return sorted(_live.keys(), key=lambda engine: _live.get(engine, 0))


def end_of_script() -> bool:
    """The worker's last meeting, through the newest live engine's collectives: a rank still training meets it and
    stops, naming the ranks whose scripts ended (a data loader that ran out on one rank). False: no engine lives."""
    engines = live()
    if not engines:
        return False
    engines[-1].comm.end_of_script()
    return True


def settle_all() -> None:
    """Finish the collectives every live engine of this process still has in flight. The worker calls it when the
    script ends (and before a script's own `destroy_process_group()`): after the last `step()` a deferred
    publish or a prefetch may still be on the wire, and gloo aborts a process whose group is torn down
    under a running collective ("terminate called without an active exception")."""
    for engine in live():
        engine.store.settle()
