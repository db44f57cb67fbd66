"""Shard arithmetic: where each parameter lives in a flat buffer and which part each rank owns.

Pure functions on integers: no tensors, no process group. Everything sharded in zerorun uses the
same picture:

    unit's flat buffer  | p0 ......| p1 ...| p2 ............|pad|
    rank shards         |  rank 0      |  rank 1      |  rank 2      |     each `shard_numel` long

A *unit* is a list of parameters laid out back to back (no per-parameter padding) in one buffer
whose length is padded to a multiple of `world_size * align`, so every rank owns exactly
`shard_numel` elements starting at `rank * shard_numel`, and each shard starts `align`-aligned.
A parameter may straddle two or more shards; `shard_pieces` says which part of it a rank owns.
The owner way's units (`whole_layout`) are laid out so none does: each rank's shard holds whole
parameters, back to back, then padding up to the fullest shard.

    whole layout        | p0 ....| p2 .|pad | p1 ......|pad|
                        |  rank 0          |  rank 1       |
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ParamSpan:
    """One parameter's place in a unit's flat buffer."""

    index: int  # position in the unit's parameter list
    offset: int  # first element in the flat buffer
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one rank's shard."""

    index: int  # parameter position in the unit
    param_start: int  # first element, counted inside the parameter
    shard_start: int  # where it lands, counted inside the rank's shard
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """A unit's flat layout across `world_size` ranks."""

    spans: tuple[ParamSpan, ...]
    world_size: int
    align: int
    numel: int  # elements holding parameters
    padded_numel: int  # multiple of world_size * align
    whole: bool = False  # laid out by `whole_layout`: padding at the end of each shard

    @functools.cached_property  # asked at every collective of the unit; the layout never changes
    def used(self) -> tuple[int, ...] | None:
        """A whole layout's elements per shard that hold parameters, from the shard's start (at least 1, so a
        collective moving only these never moves an empty tensor); None for a flat layout, where only the last
        shard ends in padding."""
        if not self.whole:
            return None
        used = [1] * self.world_size
        for span in self.spans:
            if span.numel:
                rank = span.offset // self.shard_numel
                used[rank] = max(used[rank], span.end - rank * self.shard_numel)
        return tuple(used)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of `rank`'s shard in the flat buffer."""
        assert 0 <= rank < self.world_size, f"rank {rank} outside world of {self.world_size}"
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def piece_of(self, index: int, rank: int) -> ShardPiece | None:
        """The part of parameter `index` that `rank` owns, or None."""
        span = self.spans[index]
        lo, hi = self.shard_range(rank)
        both = intersect((span.offset, span.end), (lo, hi))
        if both is None:
            return None
        return ShardPiece(index, both[0] - span.offset, both[0] - lo, both[1] - both[0])

    def owner(self, index: int) -> int | None:
        """The rank whose shard holds all of parameter `index` (None when it straddles shards, or is empty)."""
        span = self.spans[index]
        rank = span.offset // self.shard_numel
        return rank if span.numel and (span.end - 1) // self.shard_numel == rank else None

    def gaps(self) -> list[tuple[int, int]]:
        """The [lo, hi) ranges no parameter covers (the padding), in order."""
        out, at = [], 0
        for span in sorted(self.spans, key=lambda s: s.offset):
            if span.offset > at:
                out.append((at, span.offset))
            at = max(at, span.end)
        return out + ([(at, self.padded_numel)] if at < self.padded_numel else [])

    def shard_pieces(self, rank: int) -> list[ShardPiece]:
        """The parts of parameters that `rank` owns, in flat order (padding excluded)."""
        pieces = (self.piece_of(index, rank) for index in range(len(self.spans)))
        return [piece for piece in pieces if piece is not None]


def intersect(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    """The common part of two half-open ranges [lo, hi), or None when they do not overlap."""
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


@dataclass(frozen=True)
class Copy:
    """Move `numel` elements from offset `src` of holder `source` to offset `dst`."""

    source: int
    src: int
    dst: int
    numel: int


def range_copies(want: tuple[int, int], dst: int, held: Sequence[tuple[int, int, int, int]]) -> list[Copy]:
    """The copies that fill elements `want` = [lo, hi) of one parameter, landing from `dst` on.

    `held` lists pieces (source, offset, first, numel): `source` holds the parameter's elements
    [first, first + numel) from `offset` of its flat state (a checkpoint's saved ranks). When the
    pieces tile the parameter, the copies cover `want` exactly once (checkpoint loads check it).
    """
    copies = []
    for source, offset, first, numel in held:
        both = intersect(want, (first, first + numel))
        if both is not None:
            copies.append(Copy(source, offset + both[0] - first, dst + both[0] - want[0], both[1] - both[0]))
    return copies


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def flat_layout(numels: Sequence[int], world_size: int, align: int = 1) -> FlatLayout:
    """Lay parameters of the given sizes out back to back, padded to `world_size * align`.

    An empty unit still gets one aligned element per rank, so every rank has a non-empty shard
    (collectives on zero-length tensors are a needless special case).
    """
    assert world_size >= 1 and align >= 1, f"world_size={world_size}, align={align}"
    spans, offset = [], 0
    for index, numel in enumerate(numels):
        assert numel >= 0, f"parameter {index} has negative numel {numel}"
        spans.append(ParamSpan(index, offset, numel))
        offset += numel
    padded = max(round_up(offset, world_size * align), world_size * align)
    return FlatLayout(tuple(spans), world_size, align, offset, padded)


def whole_layout(numels: Sequence[int], owners: Sequence[int], world_size: int, align: int = 1) -> FlatLayout:
    """Lay parameters out so each lies whole in its owner's shard: rank r's shard holds the parameters `owners` gives
    it, in order, then padding; every shard as long as the fullest (aligned). `owners` must be non-decreasing, so the
    spans stay in flat order (the caller orders the unit's parameters by owner)."""
    assert len(numels) == len(owners) and list(owners) == sorted(owners), "owners per parameter, non-decreasing"
    assert all(0 <= r < world_size for r in owners), f"owners {owners} outside world of {world_size}"
    filled = [0] * world_size
    starts = []
    for numel, owner in zip(numels, owners):
        starts.append(filled[owner])
        filled[owner] += numel
    shard = max(round_up(max(filled, default=0), align), align)
    spans = tuple(ParamSpan(i, owner * shard + start, numel)
                  for i, (numel, owner, start) in enumerate(zip(numels, owners, starts)))
    return FlatLayout(spans, world_size, align, sum(numels), shard * world_size, whole=True)


def bucket_params(numels: Sequence[int], bucket_numel: int) -> list[list[int]]:
    """Split parameter indices, in order, into consecutive buckets of about `bucket_numel` elements.

    A parameter is never split; one larger than a bucket gets a bucket of its own. Each bucket
    holds at least one parameter.
    """
    assert bucket_numel >= 1, f"bucket_numel={bucket_numel}"
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if current and filled + numel > bucket_numel:
            buckets.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        buckets.append(current)
    return buckets
