"""How a job ended (`Outcome`, `Ending`), where the supervisor's lines go (`Output`), and what the
telemetry can testify about the ranks (`Witness`): the supervisor's vocabulary, shared with the
launcher, the recovery policy and the telemetry monitor."""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass
from typing import BinaryIO, Protocol

from zerorun.launch.streams import RankExit
from zerorun.telemetry.state import Culprit


class Ending(enum.Enum):
    """How a job ended."""

    SUCCESS = "success"
    RANK_FAILED = "rank failed"  # a rank's worker failed (or, blamed, made another fail)
    NODE_FAILED = "node failed"  # a node's torchrun (or its supervisor) failed without a rank failing
    NODE_LOST = "node lost"  # the link to a node: closed, its client killed, or no heartbeat
    SIGNAL = "signal"  # the launcher was told to stop


@dataclass(frozen=True)
class Outcome:
    """How the job ended; `exit_code` is the launcher's, `cause` the one line that names the culprit."""

    exit_code: int
    ending: Ending = Ending.SUCCESS
    cause: str = ""
    host: str | None = None  # the culprit's host
    rank: int | None = None  # the culprit rank, when it is a rank
    evidence: tuple[str, ...] = ()  # why that rank (the stall evidence), when it is not the one that failed
    failure: RankExit | None = None  # the first rank that failed
    node: int | None = None  # the culprit node's index in the plan
    signal: int | None = None  # the signal that stopped the launcher
    detected_at: float = 0.0  # wall clock when the supervisor decided the job had ended


class Output:
    """Where the supervisor's lines go: here, to stdout (fd 1) and stderr (fd 2) as they come."""

    def __init__(self, stdout: BinaryIO | None = None, stderr: BinaryIO | None = None) -> None:
        self.files = {1: stdout or sys.stdout.buffer, 2: stderr or sys.stderr.buffer}

    def write(self, fd: int, line: bytes) -> None:
        out = self.files[fd]
        try:
            out.write(line + b"\n")
            out.flush()
        except (BrokenPipeError, ValueError):
            pass  # our own output is gone (piped into `head`): keep supervising

    def tick(self) -> None:
        """Called about every 0.1 s while the job runs (and while its last output drains)."""


class Witness(Protocol):
    """What the telemetry saw of the ranks (the monitor): who was waiting, and for whom."""

    def waiting(self, rank: int) -> bool:
        """Whether `rank` was last seen waiting inside a collective."""

    def culprit(self, failed_rank: int) -> Culprit | None:
        """The rank `failed_rank` was waiting for when it failed, with the evidence."""

    def last_rss(self, rank: int) -> int | None:
        """The rank's resident memory in its last sample, in bytes."""
