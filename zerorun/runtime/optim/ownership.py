"""Which rank updates which whole parameter, for the optimizers that need parameters whole.

An optimizer whose update of a parameter depends on all of that parameter (Muon's Newton-Schulz over
the matrix, Adafactor's row and column moments, LAMB's trust ratio) cannot run over the flat pieces
a ZeRO stage gives each rank. The owner way gives each parameter to one rank instead, which updates
it whole (`owner_step.py`). This module decides who owns what: a pure function of the parameters'
costs and the world size, the same on every rank and at every resume, with no process group.

    plan = plan_ownership([cost(p) for p in params], world)
    plan.owner[i]          # the rank that updates parameter i
    plan.owned(rank)       # the indices it updates, in order
    plan.imbalance         # the busiest rank's cost over the mean (1.0: perfect)

Balance is greedy longest-processing-time: parameters by decreasing cost, each to the rank with the
least so far (ties: the lowest rank). Its busiest rank carries at most the mean plus one parameter's
cost (tests/runtime/test_ownership.py checks it over random sizes), and the plan is deterministic.
The cost is a parameter's element count by default: the owner keeps that parameter's optimizer state,
so balancing elements balances memory. A stage partition that follows these owners (each whole
gradient reduced to its owner, with no extra collective) needs nothing more than this plan.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class OwnershipPlan:
    """Each parameter's owning rank, with the cost per rank."""

    owner: tuple[int, ...]  # per parameter index
    loads: tuple[int, ...]  # per rank: the summed cost of what it owns
    world: int

    def owned(self, rank: int) -> list[int]:
        """The parameter indices `rank` owns, in index order."""
        return [i for i, r in enumerate(self.owner) if r == rank]

    @property
    def imbalance(self) -> float:
        """The busiest rank's load over the mean load (1.0 when perfectly even, or when nothing is owned)."""
        total = sum(self.loads)
        return max(self.loads) * self.world / total if total else 1.0


def plan_ownership(costs: Sequence[int], world: int) -> OwnershipPlan:
    """Assign each parameter (by its cost) to one of `world` ranks, balanced (see the module docstring)."""
    assert world >= 1, f"world={world}"
    assert all(c >= 0 for c in costs), "costs are non-negative"
    owner = [0] * len(costs)
    loads = [0] * world
    ranks = [(0, r) for r in range(world)]  # (load, rank): the least loaded first, ties to the lowest rank
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, rank = heapq.heappop(ranks)
        owner[i] = rank
        loads[rank] = load + costs[i]
        heapq.heappush(ranks, (loads[rank], rank))
    return OwnershipPlan(tuple(owner), tuple(loads), world)
