"""Where a collective's caller stands, as a tag every rank compares with its peers' before any payload moves.

Ranks of a data-parallel job must issue the same collectives in the same order. When they do not, the
backends do not notice: gloo and shared memory pair whatever comes next (rank 0's evaluation gathers
with rank 1's training gathers at stage 3: wrong values, then nan, and no error), NCCL hangs until its
timeout, and gloo's point to point aborts the process on a size mismatch. So every collective zerorun
issues carries a `Tag`: its op and size, its sequence number on the group, the unit it serves, and the
caller's `Place` in training (engine step, micro-step, the window's backward count, what the caller is
doing: a forward, a no-grad forward outside a step, a backward, the optimizer step, a state dict, a
checkpoint, the script's end). The channel (channel.py) checks the tags of all ranks before the payload
(in shared memory's meeting, or one small exchange on the wire), and a mismatch stops the job on every
rank with one message that says where each rank was and what to write instead (`DesyncError`).

Every rank decodes every rank's tag and builds the message in the same way, so each prints the same
text and the launcher shows it once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol, Sequence

from zerorun.errors import ZerorunError
from zerorun.runtime.comm.wire import Op

WORDS = 8  # int64 words per tag: one 64-byte line
MAGIC = 0x5A52_5441_4700_0000  # "ZRTAG": marks a written tag (a slot still zero is "nothing yet")
_OPS = list(Op)


class Activity(IntEnum):
    """What the caller of a collective is doing (its code is on the wire: append, never renumber)."""

    OTHER = 0  # an engine's collectives used outside its own calls
    SETUP = 1  # zerorun.initialize: parameters and buffers from rank 0
    FORWARD = 2  # a forward with gradients on: a training micro-step
    NO_GRAD_FORWARD = 3  # a forward under no_grad outside engine.backward: evaluation, generate()
    BACKWARD = 4  # inside engine.backward (recomputation included)
    STEP = 5  # the optimizer step and its publish
    STATE_DICT = 6  # engine.state_dict() / model.state_dict() / optimizer.state_dict() gathering state
    GATHERED = 7  # entering or leaving engine.gathered()
    CHECKPOINT = 8  # saving or loading a checkpoint
    SCRIPT_END = 9  # the script has returned: the worker's last meeting

    def describe(self) -> str:
        return _ACTIVITY_TEXT[self]


_ACTIVITY_TEXT = {
    Activity.OTHER: "outside the engine's calls",
    Activity.SETUP: "setting up the engine (zerorun.initialize)",
    Activity.FORWARD: "forward",
    Activity.NO_GRAD_FORWARD: "a forward outside a training step (no_grad, not in engine.backward)",
    Activity.BACKWARD: "backward",
    Activity.STEP: "optimizer step",
    Activity.STATE_DICT: "a state dict (engine.state_dict(), model.state_dict() or the optimizer's)",
    Activity.GATHERED: "engine.gathered()",
    Activity.CHECKPOINT: "a checkpoint",
    Activity.SCRIPT_END: "the end of the script (its code has returned)",
}


@dataclass(frozen=True)
class Place:
    """Where the caller stands in training; -1 where a counter is unknown (no engine)."""

    activity: Activity = Activity.OTHER
    step: int = -1  # optimizer steps taken (engine.global_step)
    micro_step: int = -1  # engine.step() calls so far
    backwards: int = -1  # engine.backward() calls in the current accumulation window


class UnitNames:
    """The units' names a mismatch message uses: a plain table (operations queued on a transport's thread carry it,
    so it must keep no engine alive)."""

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names = list(names)

    def unit_name(self, unit: int) -> str:
        return self.names[unit] if 0 <= unit < len(self.names) else f"#{unit}"


class PlaceSource(Protocol):
    """What a `Collectives` asks, at every call, for the caller's place (the engine answers)."""

    names: UnitNames

    def place(self) -> Place: ...


class Nowhere:
    """The place of collectives outside any engine (a bare `Collectives`)."""

    def __init__(self) -> None:
        self.names = UnitNames()

    def place(self) -> Place:
        return Place()


@dataclass(frozen=True)
class Tag:
    """One collective as its caller issued it: compared across ranks, field by field."""

    seq: int  # collectives issued on this group so far, this one included
    op: Op
    numel: int  # elements of the whole buffer the collective moves
    unit: int  # the unit it serves (-1: none)
    place: Place
    detail: int = 0  # what else must agree: a broadcast's source

    def words(self) -> list[int]:
        op = _OPS.index(self.op)
        return [MAGIC | op << 8 | int(self.place.activity), self.seq, self.numel, self.unit, self.place.step,
                self.place.micro_step, self.place.backwards, self.detail]

    @classmethod
    def from_words(cls, words: Sequence[int]) -> Tag | None:
        """The tag written as `words`; None for a slot nothing was written to yet."""
        head = int(words[0])
        if head & ~0xFFFF != MAGIC:
            return None
        place = Place(Activity(head & 0xFF), int(words[4]), int(words[5]), int(words[6]))
        return cls(int(words[1]), _OPS[(head >> 8) & 0xFF], int(words[2]), int(words[3]), place, int(words[7]))

    def describe(self, names: UnitNames) -> str:
        where = self.place
        counters = [] if where.step < 0 else [f"step {where.step}, micro-step {where.micro_step}"]
        if where.activity is Activity.BACKWARD and where.backwards >= 0:
            counters.append(f"backward {where.backwards} of its window")
        if where.activity is Activity.SCRIPT_END:
            return ", ".join([*counters, where.activity.describe()])
        unit = f" of unit {names.unit_name(self.unit)}" if self.unit >= 0 else ""
        source = f" from rank {self.detail}" if self.op is Op.BROADCAST else ""
        what = f"{self.op.value}{unit}{source} ({self.numel:,} elements; collective #{self.seq})"
        return ", ".join([*counters, where.activity.describe(), what])


class DesyncError(ZerorunError):
    """Ranks reached different collectives: stopped before any data moved (the message says where each was)."""


def check_agree(tags: Sequence[Tag | None], names: UnitNames) -> None:
    """Raise `DesyncError` unless every rank's tag is the same (None: a rank that has not written one)."""
    first = tags[0]
    if all(tag == first for tag in tags[1:]) and first is not None:
        return
    raise DesyncError(mismatch_message(tags, names))


def mismatch_message(tags: Sequence[Tag | None], names: UnitNames) -> str:
    """The same text on every rank: where each rank was, and what to write instead."""
    lines = ["ranks reached different collectives, so they would exchange the wrong data; stopped before any "
             "moved. Every rank must issue the same collectives in the same order:"]
    for rank, tag in enumerate(tags):
        lines.append(f"  rank {rank}: " + (tag.describe(names) if tag is not None else
                                           "not at this collective (still computing, or in one zerorun did not issue)"))
    lines.append(_advice([tag for tag in tags if tag is not None]))
    return "\n".join(lines)


def _advice(tags: list[Tag]) -> str:
    """What to write instead, for the habit the places point at."""
    doing = {tag.place.activity for tag in tags}
    if len(doing) > 1 and Activity.NO_GRAD_FORWARD in doing:
        return ("A forward on some ranks only (evaluation or generate() under `if rank == 0:`): at stage 3 every "
                "forward gathers parameters from every rank. Evaluate on every rank and print on rank 0, or gather "
                "the weights on every rank first: `with engine.gathered(): if rank == 0: evaluate(model)` "
                "(docs/coming-from-ddp.md).")
    if len(doing) > 1 and Activity.STATE_DICT in doing:
        return ("A state dict on some ranks only: at stage 3 `model.state_dict()` and `engine.state_dict()` gather "
                "every parameter from every rank, and `optimizer.state_dict()` gathers the optimizer's state at every "
                "stage. Call them on every rank and save on rank 0 (`sd = {'model': model.state_dict(), "
                "'optimizer': optimizer.state_dict()}` then `if rank == 0: torch.save(sd, path)`), or use "
                "engine.save_checkpoint() (docs/coming-from-ddp.md).")
    if Activity.SCRIPT_END in doing:
        return ("Some ranks' scripts returned while others still train: a data loader that ran out early on one "
                "rank, or a loop bound that differs by rank. Give every rank the same number of batches "
                "(DistributedSampler(..., drop_last=True), or stop every rank at the same step).")
    if len({(t.place.step, t.place.micro_step, t.place.backwards) for t in tags}) > 1:
        return ("The ranks counted different micro-steps or backward passes: engine.step() or engine.backward() was "
                "called a different number of times on some ranks (a skipped batch or backward, a condition that "
                "differs by rank, another accumulation count).")
    return ("The same place issued different collectives: code that depends on the rank or on the data (a module "
            "used on some ranks only, a different model or recipe per rank).")
