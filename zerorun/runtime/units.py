"""Units: buckets of parameters laid out flat and sharded together, the granule of every stage.

A unit is one `FlatLayout` (partition.py) over a few parameters of one optimizer param group:

    a unit's flat buffer   | p0 ......| p1 ...| p2 ............|pad|
    this rank's piece      |  r0          |  r1          |  r2          |    (equal, aligned)
    per group state        | u0.piece | u1.piece | ...                       master, moments, gradient shard

Its gradients are reduced with one reduce-scatter (or all-reduce) and its parameters gathered with
one all-gather, so a unit is both the reduce bucket and the gather bucket. A param group whose optimizer
needs parameters whole (the owner way) is cut with `whole`: each unit's pieces then hold whole
parameters, each in its owning rank's piece (`partition.whole_layout`, `ownership.py`). Stages 0-2 keep all
units back to back in one flat parameter buffer (`flat_offset`); stage 3 gives each its own buffer
and groups them into module units (`module_units.py`). This rank's state for a param group is one
contiguous fp32 tensor: its units' pieces in unit order, starting at each unit's `state_offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zerorun.runtime.ownership import Balance
from zerorun.runtime.partition import FlatLayout, bucket_params, flat_layout, whole_layout

ALIGN_BYTES = 64  # each rank's piece starts on a cache line / vector boundary


@dataclass
class Unit:
    """A bucket of parameters laid out and sharded together."""

    group: int  # optimizer param group
    params: list[nn.Parameter]
    shapes: list[torch.Size]  # the parameters' shapes (a released stage 3 parameter is an empty tensor)
    layout: FlatLayout
    state_offset: int  # start of this rank's piece in its group's state (master, moments, gradient shard)
    flat_offset: int = 0  # stages 0-2: start of the unit in the flat parameter buffer

    @property
    def padded_numel(self) -> int:
        return self.layout.padded_numel

    @property
    def shard_numel(self) -> int:
        return self.layout.shard_numel

    def piece(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """`rank`'s piece of a tensor laid out like this unit (the unit's gathered buffer or gradients)."""
        start, end = self.layout.shard_range(rank)
        return full[start:end]

    def state_slice(self, group_state: torch.Tensor) -> torch.Tensor:
        """This unit's part of a per-group, per-rank state tensor (master, moments, gradient shard)."""
        return group_state[self.state_offset:self.state_offset + self.shard_numel]


def align_elements(dtype: torch.dtype) -> int:
    """Elements of `dtype` per alignment boundary."""
    return max(1, ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())


def cut_units(group: int, params: list[nn.Parameter], bucket_numel: int, world: int, dtype: torch.dtype,
              state_offset: int = 0, flat_offset: int | None = None, whole: Balance | None = None) -> list[Unit]:
    """`params` (in this order) cut into units of about `bucket_numel` elements, sharded over `world`.

    State offsets continue from `state_offset`; with `flat_offset`, units also lie back to back in
    one flat buffer from there (stages 0-2), else each unit has a buffer of its own (stage 3). With
    `whole`, each parameter lies whole in its owner's piece, a unit's parameters ordered by owner.
    """
    units = []
    for members, layout in _laid_out(params, bucket_numel, world, align_elements(dtype), whole, flat_offset is None):
        units.append(Unit(group, members, [p.shape for p in members], layout, state_offset, flat_offset or 0))
        state_offset += layout.shard_numel
        if flat_offset is not None:
            flat_offset += layout.padded_numel
    return units


def own_buffer_shapes(params: list[nn.Parameter], bucket_numel: int) -> list[list[torch.Size]]:
    """The shapes of each unit `cut_units` makes of `params` where units have buffers of their own (stage 3):
    what a `Balance` is given to plan before they are cut."""
    return [[params[i].shape for i in indices] for indices in bucket_params([p.numel() for p in params], bucket_numel)]


def _laid_out(params: list[nn.Parameter], bucket_numel: int, world: int, align: int, whole: Balance | None,
              own_buffers: bool) -> list[tuple[list[nn.Parameter], FlatLayout]]:
    """Each unit's parameters and layout. Flat: consecutive buckets. Whole, each unit with a buffer of its own
    (stage 3's, within a module): the unit's parameters placed as they come. Whole, units that are only buckets
    (stages 0-2): every parameter placed at once, each rank's piece about a bucket."""
    if not params:
        return []
    if whole is None:
        buckets = [[params[i] for i in indices] for indices in bucket_params([p.numel() for p in params], bucket_numel)]
        return [(members, flat_layout([p.numel() for p in members], world, align)) for members in buckets]
    if own_buffers:
        placed = []
        for indices in bucket_params([p.numel() for p in params], bucket_numel):
            owners = whole.owners([params[i].shape for i in indices])
            placed.append(sorted(zip(indices, owners), key=lambda item: (item[1], item[0])))
    else:
        placed = whole.buckets([p.shape for p in params], max(1, bucket_numel // world))
    return [([params[i] for i, _ in unit], whole_layout([params[i].numel() for i, _ in unit], [r for _, r in unit],
                                                       world, align)) for unit in placed]


def group_numels(units: list[Unit], groups: int) -> list[int]:
    """Elements of this rank's state per param group (the sum of its units' pieces)."""
    return [sum(u.shard_numel for u in units if u.group == g) for g in range(groups)]
