"""Each collective's tag, numbered in issue order and checked across ranks before its payload (places.py says why).

Two checks, one per kind of transport:
- shared memory (shm_collectives.py): every rank writes its tag into the segment's header before the operation's
  first meeting and reads everyone's after it, before any slot is read.
- the wire (gloo, NCCL): one all-reduce (MAX) of two integers per collective, a 64-bit fingerprint of the tag and its
  negation, on a gloo group of its own; equal fingerprints on every rank mean equal tags. Its own group, on either
  backend: NCCL's group for device tensors would make the host wait for the device, and gloo's payload group would
  queue the 16 bytes behind every megabyte already posted to that pair's TCP stream (a prefetched all-gather), so
  the next collective's launch would wait for the transfers before it to cross: over a 1 Gbit/s link a stage-3
  AdamW step took 6.67 s that way and 5.14 s on its own group (`zerorun bench step --cluster 2x1 --link 1gbit`).
  Only after a mismatch do the ranks exchange their whole tags, to say where each was. Its cost is a host round
  trip per collective and, more, the wait for the last rank to arrive: 1.10-1.11x a step of the standard GPT over
  gloo at stages 2-3, measured while it still shared the payload's group (docs/benchmarks.md).
The exchange is blocking, on the caller's thread, before the payload is posted: a rank never posts a payload its
peers are not posting too, so a size mismatch can neither hang NCCL nor abort gloo's point to point first.
A peer that never comes to a collective at all (stuck in its own code) cannot be told from a slow one here; the
stall report names where each rank is, its last collective included (`last`, sent with the probe's samples).
"""

from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist

from zerorun.runtime.comm.dist import joined
from zerorun.runtime.comm.places import WORDS, Activity, DesyncError, Nowhere, Place, PlaceSource, Tag, check_agree
from zerorun.runtime.comm.wire import Op


class TagCheck:
    """Numbers the collectives of one `Collectives` (and of those that share its tags) and checks them on the wire."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int, own_group: bool,
                 timeout_s: float) -> None:
        """`own_group`: the fingerprints go on a gloo group made for them (every rank of the world must make the same
        call: the same `own_group`); else on `group` itself (shared memory carries the tags in its header: the group
        sees only what shared memory cannot carry, a tensor that is not contiguous on the host)."""
        self.places: PlaceSource = Nowhere()  # the engine sets itself: where the caller stands at each call
        self.rank, self.world_size = rank, world_size
        self.seq = 0
        self.last: Tag | None = None  # the latest collective issued: where the stall report says this rank is
        self.failed: DesyncError | None = None  # once ranks disagreed, every later collective raises the same
        self._wire = group
        if own_group and world_size > 1:
            ranks = None if group is None else dist.get_process_group_ranks(group)
            self._wire = joined(dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))

    def next(self, op: Op, numel: int, unit: int = -1, detail: int = 0) -> Tag:
        """The tag of the collective about to be issued, where the caller stands now. After a mismatch, raises it
        again: the cleanup that runs while it unwinds (a backward's last reduce-scatters) must not wait for peers
        that have stopped."""
        if self.failed is not None:
            raise self.failed
        self.seq += 1
        self.last = Tag(self.seq, op, numel, unit, self.places.place(), detail)
        return self.last

    def end(self) -> Tag:
        """The tag of the worker's last meeting: the script has returned (at the caller's last counters)."""
        self.seq += 1
        now = self.places.place()
        self.last = Tag(self.seq, Op.ALL_REDUCE, 0, -1, Place(Activity.SCRIPT_END, now.step, now.micro_step,
                                                              now.backwards))
        return self.last

    def on_wire(self, tag: Tag) -> None:
        """Return once every rank has issued a collective with this very tag; else raise `DesyncError` on every rank."""
        mine = fingerprint(tag)
        extremes = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self._wire)
        if int(extremes[0]) == mine and -int(extremes[1]) == mine:
            return
        everyone = torch.zeros((self.world_size, WORDS), dtype=torch.int64)
        everyone[self.rank] = torch.tensor(tag.words(), dtype=torch.int64)
        dist.all_reduce(everyone, group=self._wire)  # every row is one rank's: the sum is the table
        try:
            check_agree([Tag.from_words(row) for row in everyone.tolist()], self.places.names)
        except DesyncError as mismatch:
            self.failed = mismatch
            raise
        raise AssertionError("fingerprints differ but tags agree")  # a hash collision the other way round cannot be


def fingerprint(tag: Tag) -> int:
    """A 62-bit digest of the tag's words: the same on every rank for the same tag, and its negation fits int64."""
    raw = b"".join(word.to_bytes(8, "little", signed=True) for word in tag.words())
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 2
