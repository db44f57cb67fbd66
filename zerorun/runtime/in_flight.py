"""What an update may leave running past the call that made it, and the one place that settles it.

Two things outlive the engine call that starts them:

| in flight                     | started by                               | settled by            |
|-------------------------------|------------------------------------------|-----------------------|
| a speculative host update     | the window's last `backward()` (`zero.overlap_optimizer`, optim/overlap.py) | rolled back (`Need.STATE`): the state as it was before it |
| the parameters' publish       | `step()` (stages 1/2 with `zero.overlap_publish`, deferred_publish.py) | waited for (`Need.PARAMETERS`): every rank's parameters current |

Every entry point of the engine that reads or changes the parameters or their state declares what it
needs (`@settles(Need...)`, engine.py), and `InFlight.settle` is the only code that settles either:
the step that claims a speculation (`Update.apply`) is the one other way it ends.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Any, Callable, Protocol, TypeVar

from zerorun.runtime.deferred_publish import DeferredPublish


class Need(Enum):
    """What an engine call needs settled before it runs."""

    STATE = "state"  # the optimizer state as it is (a speculation rolled back); parameters may still be landing
    PARAMETERS = "parameters"  # that, and every rank's parameters current (the publish waited for)


class Speculating(Protocol):
    """The update's side of it (optim/update.py)."""

    def settle(self) -> None:
        """Roll back an update made under the backward that no step has claimed."""


class InFlight:
    """The speculation and the publish an engine may have in flight; `settle(need)` is their one exit."""

    def __init__(self, update: Speculating, publish: DeferredPublish | None) -> None:
        self.update, self.publish = update, publish

    def settle(self, need: Need) -> None:
        self.update.settle()
        if need is Need.PARAMETERS:
            self.wait_published()

    def wait_published(self) -> None:
        """Wait until every rank's parameters hold the last step's update (nothing when it is published in `step`)."""
        if self.publish is not None:
            self.publish.wait_all()


class HasInFlight(Protocol):
    in_flight: InFlight


Method = TypeVar("Method", bound=Callable[..., Any])


def settles(need: Need) -> Callable[[Method], Method]:
    """Decorate an engine method that needs `need` settled before it runs."""
    def decorate(method: Method) -> Method:
        @functools.wraps(method)
        def entry(self: HasInFlight, *args: Any, **kwargs: Any) -> Any:
            self.in_flight.settle(need)
            return method(self, *args, **kwargs)
        return entry  # type: ignore[return-value]
    return decorate
