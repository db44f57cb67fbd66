"""One attribute of an object outside zerorun (a function of a torch module), replaced while it is held.

Every replacement zerorun makes of something it does not own goes through `AttributePatch`: the first
`hold()` saves the original and sets the replacement, the last release puts the original back. So a
process in which nothing holds a patch has torch exactly as torch made it (tests/runtime/test_interop.py).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

log = logging.getLogger("zerorun")


class AttributePatch:
    """`owner.name` replaced by `wrap(original)` while at least one holder holds it."""

    def __init__(self, owner: object, name: str, wrap: Callable[[Any], Any]) -> None:
        self.owner, self.name, self._wrap = owner, name, wrap
        self._holders = 0
        self._original: Any = None
        self._installed: Any = None

    @property
    def held(self) -> bool:
        return self._holders > 0

    def hold(self) -> Callable[[], None]:
        """Install the replacement (if no one holds it yet); returns the release, which is safe to call twice."""
        if self._holders == 0:
            self._original = getattr(self.owner, self.name)
            self._installed = self._wrap(self._original)
            setattr(self.owner, self.name, self._installed)
        self._holders += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._release()
        return release

    def _release(self) -> None:
        assert self._holders > 0, f"{self.name}: released more often than held"
        self._holders -= 1
        if self._holders:
            return
        if getattr(self.owner, self.name) is self._installed:
            setattr(self.owner, self.name, self._original)
        else:  # someone replaced ours since: theirs stays (it may wrap ours, and removing it is their call)
            log.warning("zerorun: %s.%s was replaced while zerorun's wrapper was installed; left as it is now",
                        getattr(self.owner, "__name__", type(self.owner).__name__), self.name)
        self._original = self._installed = None


def hold_all(patches: Iterable[AttributePatch]) -> Callable[[], None]:
    """Hold every one of `patches` until the returned release is called (safe to call twice)."""
    releases = [patch.hold() for patch in patches]

    def release() -> None:
        for each in releases:
            each()
    return release
