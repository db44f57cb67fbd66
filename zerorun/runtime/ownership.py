"""Which rank updates which whole parameter, for the optimizers that need parameters whole.

An optimizer whose update of a parameter depends on all of that parameter (Muon's Newton-Schulz over
the matrix, Adafactor's row and column moments, LAMB's trust ratio) cannot run over a flat piece that
holds part of a matrix. The owner way gives each parameter to one rank instead, and the stage's
layout follows it (`partition.whole_layout`): rank r's piece of a unit holds exactly the parameters r
owns, whole. The stage's own reduce-scatter then delivers each whole gradient to its owner and its
all-gather returns each whole updated parameter: no collective beyond the stage's own.

    owners = place_units([(numels, costs), ...], world, loads)   # per unit, each parameter's rank
    plan = OwnershipPlan.of(owners[0], numels, world)            # what the memory report says of one

Two things are balanced at once. The unit's pieces: every rank's piece is as long as the fullest one, so
a unit is cut into pieces of about an even share each, by size (`pieces`). And the optimizer's work, over
all units (`place_units`): units with the costliest piece first, each unit's costliest piece to the rank
with the least work so far. Newton-Schulz costs about m²·(2n + m) per m x n matrix, m <= n
(`matrix_cost`), not its size. A pure function of sizes, costs and the world size: the same on every
rank and at every resume.
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
    """The owning rank of each of one unit's parameters, the unit placed on its own (`place_units`). `loads`: each
    rank's cost so far; it is updated."""
    return place_units([(numels, costs)], world, loads)[0]


def place_units(units: Sequence[tuple[Sequence[int], Sequence[int]]], world: int, loads: list[int]) -> list[list[int]]:
    """The owning rank of each parameter of each unit, given as (sizes, costs), all units at once. `loads`: each
    rank's cost so far; it is updated.

    Each unit is cut into `world` pieces by size alone (`pieces`). Then the units are taken costliest piece first,
    wherever they lie in the model, and each unit's pieces go to the ranks by work: its costliest piece to the
    rank with the least work so far, its next to the next. So a whole embedding is placed before the blocks and
    evens out among them (in the model's order it came last and tipped the balance), and consecutive blocks whose
    matrices cannot cut evenly give their fuller piece to different ranks: what each rank sends over a step
    evens out too."""
    assert world >= 1 and len(loads) == world, f"world={world}, loads={loads}"
    cut = []
    for numels, costs in units:
        assert len(numels) == len(costs) and all(c >= 0 for c in costs), "a non-negative cost per parameter"
        piece = pieces(numels, world)
        cut.append((piece, [sum(c for c, p in zip(costs, piece) if p == q) for q in range(world)],
                    [sum(n for n, p in zip(numels, piece) if p == q) for q in range(world)]))
    placed: list[list[int]] = [[] for _ in units]
    for k in sorted(range(len(units)), key=lambda k: (-max(cut[k][1], default=0), k)):
        piece, work, filled = cut[k]
        rank_of = [0] * world
        by_load = sorted(range(world), key=lambda r: (loads[r], r))  # the least work so far first
        for rank, p in zip(by_load, sorted(range(world), key=lambda p: (-work[p], -filled[p], p))):
            rank_of[p] = rank
            loads[rank] += work[p]
        placed[k] = [rank_of[p] for p in piece]
    return placed


def pieces(numels: Sequence[int], world: int) -> list[int]:
    """Each parameter's piece of a unit cut into `world` (0 .. world-1), by size: the largest first, each into the
    emptiest piece with room for it (an even share of the unit, or its largest parameter), else the emptiest."""
    room = max(max(numels, default=0), -(-sum(numels) // world))
    filled = [0] * world
    piece = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        piece[i] = min(range(world), key=lambda p: (filled[p] + numels[i] > room, filled[p], p))
        filled[piece[i]] += numels[i]
    return piece


def balanced(costs: Sequence[int], world: int) -> list[int]:
    """Each item's rank, greedy longest-processing-time (the costliest first, to the least loaded rank): the busiest
    rank's cost is at most the mean plus one item's (tests/runtime/test_ownership.py checks it)."""
    loads, owner = [0] * world, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        owner[i] = min(range(world), key=lambda r: (loads[r], r))
        loads[owner[i]] += costs[i]
    return owner


class Balance:
    """The owner way's placement over a param group's units, with the costs carried over: all units at once when
    they were `plan`ned (stage 3 plans the model's units before it lays them out), else one at a time."""

    def __init__(self, cost: Cost, world: int) -> None:
        self.cost, self.loads = cost, [0] * world
        self._planned: list[tuple[list[torch.Size], list[int]]] = []  # (shapes, owners): the next asked for last

    def plan(self, units: Sequence[Sequence[torch.Size]]) -> None:
        """Place these units (their parameters' shapes, in the order `owners` will be asked for them) together."""
        owners = place_units([([s.numel() for s in shapes], [self.cost(s) for s in shapes]) for shapes in units],
                             len(self.loads), self.loads)
        planned = [(list(shapes), placed) for shapes, placed in zip(units, owners)]
        self._planned = planned[::-1] + self._planned  # asked for after what was planned before

    def owners(self, shapes: Sequence[torch.Size]) -> list[int]:
        """The owning rank of each of one unit's parameters (by their shapes)."""
        if self._planned:
            planned, owners = self._planned.pop()
            assert planned == list(shapes), f"a unit of {list(shapes)} asked for where {planned} was planned"
            return owners
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
