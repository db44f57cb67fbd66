"""Which rank updates which whole parameter, for the optimizers that need parameters whole.

An optimizer whose update of a parameter depends on all of that parameter (Muon's Newton-Schulz over
the matrix, Adafactor's row and column moments, LAMB's trust ratio) cannot run over a flat piece that
holds part of a matrix. The owner way gives each parameter to one rank instead, and the stage's
layout follows it (`partition.whole_layout`): rank r's piece of a unit holds exactly the parameters r
owns, whole. The stage's own reduce-scatter then delivers each whole gradient to its owner and its
all-gather returns each whole updated parameter: no collective beyond the stage's own.

    owners = place_whole(numels, costs, world, loads)   # one unit's parameters; `loads` carries on
    plan = OwnershipPlan.of(owners, numels, world)        # what the memory report says of it

Two things are balanced at once. The optimizer's work: each parameter goes to the rank with the least
cost so far, over all units (`loads`), largest cost first (greedy longest-processing-time). Newton-Schulz
costs about m²·(2n + m) per m x n matrix, m <= n (`matrix_cost`), not its size. And the unit's pieces: every
rank's piece is as long as the fullest one, so a parameter goes only where it keeps that piece
within an even share of the unit (or of its largest parameter); where none has room, to the emptiest
piece. A pure function of sizes, costs and the world size: the same on every rank and at every resume.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

Cost = Callable[[torch.Size], int]  # a whole parameter's optimizer work, by its shape


def size_cost(shape: torch.Size) -> int:
    """Work in proportion to the parameter's elements (Adafactor, LAMB, ...)."""
    return shape.numel()


def matrix_cost(shape: torch.Size) -> int:
    """Newton-Schulz's work on a matrix (Muon): each iteration forms A = X·Xᵀ over the shorter side m (m²·n), A·A
    (m³) and that times X (m²·n), for m <= n: m²·(2n + m). A parameter of more dimensions is taken as its first
    dimension by the rest, as Muon's implementations do."""
    if len(shape) < 2:
        return shape.numel()
    rows = shape[0]
    cols = shape.numel() // max(rows, 1)
    m, n = min(rows, cols), max(rows, cols)
    return m * m * (2 * n + m)


@dataclass(frozen=True)
class OwnershipPlan:
    """Each parameter's owning rank, with what each rank owns in all."""

    owner: tuple[int, ...]  # per parameter index
    loads: tuple[int, ...]  # per rank: the summed size of what it owns
    world: int

    @staticmethod
    def of(owners: Sequence[int], sizes: Sequence[int], world: int) -> OwnershipPlan:
        loads = [0] * world
        for owner, size in zip(owners, sizes, strict=True):
            loads[owner] += size
        return OwnershipPlan(tuple(owners), tuple(loads), world)

    def owned(self, rank: int) -> list[int]:
        """The parameter indices `rank` owns, in index order."""
        return [i for i, r in enumerate(self.owner) if r == rank]

    @property
    def imbalance(self) -> float:
        """The busiest rank's load over the mean load (1.0 when perfectly even, or when nothing is owned)."""
        total = sum(self.loads)
        return max(self.loads) * self.world / total if total else 1.0


def place_whole(numels: Sequence[int], costs: Sequence[int], world: int, loads: list[int]) -> list[int]:
    """The owning rank of each of one unit's parameters (see the module docstring). `loads`: each rank's cost so
    far, over the units placed before this one; it is updated."""
    assert world >= 1 and len(loads) == world, f"world={world}, loads={loads}"
    assert len(numels) == len(costs) and all(c >= 0 for c in costs), "a non-negative cost per parameter"
    room = max(max(numels, default=0), -(-sum(numels) // world))  # an even share, or the largest parameter
    filled = [0] * world
    owner = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-costs[i], -numels[i], i)):
        fits = [r for r in range(world) if filled[r] + numels[i] <= room]
        candidates = fits or [min(range(world), key=lambda r: (filled[r], r))]
        rank = min(candidates, key=lambda r: (loads[r], filled[r], r))
        owner[i] = rank
        filled[rank] += numels[i]
        loads[rank] += costs[i]
    return owner


def balanced(costs: Sequence[int], world: int) -> list[int]:
    """Each item's rank, greedy longest-processing-time (the costliest first, to the least loaded rank): the busiest
    rank's cost is at most the mean plus one item's (tests/runtime/test_ownership.py checks it)."""
    loads, owner = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner[i] = min(range(world), key=lambda r: (loads[r], r))
        loads[owner[i]] += costs[i]
    return owner


class Balance:
    """The owner way's placement over a param group's units, one unit at a time, with the costs carried over."""

    def __init__(self, cost: Cost, world: int) -> None:
        self.cost, self.loads = cost, [0] * world

    def owners(self, shapes: Sequence[torch.Size]) -> list[int]:
        """The owning rank of each of one unit's parameters (by their shapes)."""
        return place_whole([s.numel() for s in shapes], [self.cost(s) for s in shapes], len(self.loads), self.loads)

    def buckets(self, shapes: Sequence[torch.Size], bucket_numel: int) -> list[list[tuple[int, int]]]:
        """Stages 0-2, where a unit is only a bucket: every parameter placed at once (`balanced`), then units of
        (index, owner) cut so that each rank's piece is about `bucket_numel`, each rank's parameters in order."""
        owners = balanced([self.cost(s) for s in shapes], len(self.loads))
        for index, owner in enumerate(owners):
            self.loads[owner] += self.cost(shapes[index])
        queues = [[i for i, r in enumerate(owners) if r == rank] for rank in range(len(self.loads))]
        units: list[list[tuple[int, int]]] = []
        while any(queues):
            unit = []
            for rank, queue in enumerate(queues):
                filled = 0
                while queue and (filled == 0 or filled + shapes[queue[0]].numel() <= bucket_numel):
                    filled += shapes[queue[0]].numel()
                    unit.append((queue.pop(0), rank))
            units.append(unit)
        return units
