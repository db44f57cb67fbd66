"""Tracebacks held back until the job's end says whose is the cause and whose are its victims.

When rank 1 raises, rank 0 usually fails too, waiting in a collective for rank 1 ("rank 1 exited
while this rank waited for it"), and torchrun reports both. Printed as they came, the victim's
traceback (its output relay may be faster), then torchrun's report, came before the line naming
rank 1: about 75 lines to scroll past. So a rank's output from a `Traceback (most recent call
last):` line on is held here instead of printed, and so is torchrun's once a rank has failed:

- the rank ends with exit code 0, or `HOLD_S` pass with no failure in the job (a script that
  printed a traceback and went on): its held lines are printed as they were, in order;
- the job fails: the supervisor prints the culprit's held traceback first, whole, then one line
  per victim (its exception line), and writes everything held to a file under `runs/<name>/`.

Each hold keeps at most `MAX_HELD` lines (the last ones: a traceback's end says most).
"""

from __future__ import annotations

import re
import time
from collections import deque
from dataclasses import dataclass, field

HOLD_S = 5.0  # a traceback with no failure in the job after this long: the script caught it and went on
MAX_HELD = 2000  # lines kept per rank (RecursionError tracebacks are about 1,000 lines even collapsed)
TRACEBACK = b"Traceback (most recent call last):"
_PREFIX = re.compile(rb"^\[[^\]\s]+:[^\]\s]+\] ")
# A traceback's last line names the exception: `ValueError: bad batch`, `torch.OutOfMemoryError: ...`,
# `KeyboardInterrupt` (no indent, not one of the lines that chain tracebacks).
_EXCEPTION = re.compile(rb"^(?:[A-Za-z_][\w.]*\.)?[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Warning)\b")

Key = tuple[str, "int | str"]  # (host, rank), or (host, "torchrun")


@dataclass
class _Hold:
    started: float
    lines: deque[tuple[int, bytes]] = field(default_factory=lambda: deque(maxlen=MAX_HELD))


class HeldOutput:
    """Per rank (and per node's torchrun), the lines held since a traceback began."""

    def __init__(self) -> None:
        self._holds: dict[Key, _Hold] = {}

    def take(self, key: Key, fd: int, line: bytes, hold: bool = False, now: float | None = None) -> bool:
        """Whether `line` is held (else the caller prints it now). A traceback's first line starts a
        hold; `hold` starts one whatever the line (torchrun's output once a rank has failed)."""
        held = self._holds.get(key)
        if held is None and (hold or _text(line).startswith(TRACEBACK)):
            held = self._holds[key] = _Hold(time.monotonic() if now is None else now)
        if held is None:
            return False
        held.lines.append((fd, line))
        return True

    def holding(self, key: Key) -> bool:
        return key in self._holds

    def release(self, key: Key) -> list[tuple[int, bytes]]:
        """Stop holding `key`: its lines, to print as they were (it ended well, or went on)."""
        held = self._holds.pop(key, None)
        return list(held.lines) if held is not None else []

    def release_stale(self, now: float | None = None) -> list[tuple[int, bytes]]:
        """Every hold older than `HOLD_S` (the caller asks only while no rank has failed)."""
        now = time.monotonic() if now is None else now
        stale = [key for key, held in self._holds.items() if now - held.started >= HOLD_S]
        return [item for key in stale for item in self.release(key)]

    def release_all(self) -> list[tuple[int, bytes]]:
        return [item for key in list(self._holds) for item in self.release(key)]

    def lines(self, key: Key) -> list[bytes]:
        held = self._holds.get(key)
        return [line for _, line in held.lines] if held is not None else []

    def keys(self) -> list[Key]:
        return list(self._holds)

    def exception(self, key: Key) -> str | None:
        """The exception line of the last traceback `key` printed (`RuntimeError: ...`), prefix removed."""
        for line in reversed(self.lines(key)):
            text = _text(line)
            if _EXCEPTION.match(text):
                return text.decode("utf-8", "replace").strip()
        return None


def _text(line: bytes) -> bytes:
    """A rank's line without its `[host:rank] ` prefix."""
    return _PREFIX.sub(b"", line, count=1)
