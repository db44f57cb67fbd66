"""hpZ: a secondary copy of stage 3's parameters, partitioned within the node (`zero.hpz_partition_size`).

Stage 3 gathers a unit for the forward and again for the backward, each time from every rank: two
thirds of its bytes cross the link between nodes. With hpZ (ZeRO++), once a unit has been gathered,
each rank keeps one piece of it out of `hpz_partition_size` (the ranks of its node); the next gather
of that unit (the backward, a later micro-step's forward) is an all-gather among those ranks only,
so it never crosses the link. The copy stays valid until the parameters change (the optimizer
step, a checkpoint load, a `gathered(modify=True)`), so it holds exactly the values the first gather
delivered: training is bit-identical to plain stage 3 (`tests/runtime/test_hpz.py`). It costs
param-dtype bytes of 1 / `hpz_partition_size` of the model per rank (`zerorun estimate` counts it).

Secondary groups are consecutive ranks, as launchers place them on nodes: ranks [0, L) form the
first, [L, 2L) the next. Its gathers go through shared memory where the node allows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.runtime.comm.collectives import Collectives, CpuCollectives, Handle
from zerorun.runtime.comm.dist import joined
from zerorun.runtime.units import Unit


class SecondaryPartition:
    """Each unit's piece of this rank within its node group, kept after a full gather until it goes stale."""

    def __init__(self, units: list[Unit], comm: Collectives, size: int, cpu: CpuCollectives,
                 timeout_s: float) -> None:
        if comm.world_size % size:
            raise ZerorunError(f"zero.hpz_partition_size: {size} does not divide the world size {comm.world_size}; "
                               f"set it to the ranks per node (a divisor of the world size), or 1 for off.")
        groups = [dist.new_group(list(range(start, start + size))) for start in range(0, comm.world_size, size)]
        # its gathers happen at the same place on every rank: numbered and checked with the world's collectives
        self.comm = Collectives(joined(groups[comm.rank // size]), cpu=cpu, timeout_s=timeout_s, tags=comm.tags,
                                runtime=comm.runtime)
        self.size, self.rank = size, comm.rank % size
        self.units = units
        self.pieces: list[torch.Tensor | None] = [None] * len(units)  # allocated at the first full gather
        self.valid = [False] * len(units)  # False: stale, gather from every rank
        self.generation = 0  # counts invalidations: a gather begun before one must not be kept

    def holds(self, k: int) -> bool:
        return self.valid[k]

    def gather(self, k: int, full: torch.Tensor) -> Handle:
        """Fill unit k's `full` buffer from the node group's pieces (valid copies only)."""
        piece = self.pieces[k]
        assert piece is not None and self.valid[k], f"hpZ: unit {k} has no valid secondary piece"
        full.view(self.size, -1)[self.rank].copy_(piece)
        return self.comm.all_gather(full, unit=k)

    def keep(self, k: int, full: torch.Tensor) -> None:
        """After a gather from every rank: keep this rank's node-group piece of `full`."""
        own = full.view(self.size, -1)[self.rank]
        piece = self.pieces[k]
        if piece is None:
            self.pieces[k] = own.clone()
        else:
            piece.copy_(own)
        self.valid[k] = True

    def invalidate(self) -> None:
        """The parameters changed: every copy is stale (its memory is kept for the next gather)."""
        self.valid = [False] * len(self.units)
        self.generation += 1

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pieces if p is not None)
