"""Stage 3's gathered buffers: the memory and the collectives of one unit's gather, by its slot in the plan.

Each unit has a gathered buffer whose storage is emptied when released and given memory again when
gathered, so the module's parameters (views into it) and tensors autograd saved during forward
stay valid across release and re-gather. The memory comes from a `BlockCache` (memory.py) on the
host, and from the allocator (`resize_`) on CUDA, whose caching allocator keeps freed blocks
itself. A gather fills this rank's piece from the parameter shard (`param_shards.py`: the master
itself, a compute-dtype tensor, or NVMe files) and all-gathers the rest; with hpZ (hpz.py), a unit
whose node-group piece is still valid is gathered within the node instead.

`UnitBuffers` is what every `UnitGroup` (unit_group.py) is bound to, its `GatherBuffers`. It holds
no reference to the groups or to the store that owns it, so a store, its groups and its buffers are
a tree that is freed with the engine, not a cycle left to the garbage collector.
"""

from __future__ import annotations

import torch

from zerorun.runtime.comm.collectives import Collectives, Handle
from zerorun.runtime.memory import gather_blocks
from zerorun.runtime.stage3.hpz import SecondaryPartition
from zerorun.runtime.stage3.param_shards import ParamShard
from zerorun.runtime.units import Unit


class UnitBuffers:
    """Every unit's gathered buffer and its parameters' views; gather, landed and free by slot."""

    def __init__(self, units: list[Unit], shard: ParamShard, comm: Collectives, hpz: SecondaryPartition | None,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.units, self.shard, self.comm, self.hpz = units, shard, comm, hpz
        self.rank = comm.rank
        self.blocks = gather_blocks(device)  # where gathered buffers get their memory
        self._full_gathers: dict[int, int] = {}  # unit -> hpz generation when its gather from every rank began
        # each unit's gathered buffer and its parameters' views, made one unit at a time and emptied at once: all of
        # them at once would hold the whole model in the compute dtype beside the model the script built
        self.full: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        for u in units:
            full = torch.empty(u.padded_numel, dtype=dtype, device=device)
            self.views.append([full[span.offset:span.end].view(shape) for span, shape in zip(u.layout.spans, u.shapes)])
            full.untyped_storage().resize_(0)  # never used: back to the allocator, not into `blocks`
            self.full.append(full)
        self.peak_gathered_bytes = 0

    def gather(self, slot: int) -> Handle:
        unit, full = self.units[slot], self.full[slot]
        self.blocks.fill(full.untyped_storage(), full.numel() * full.element_size())
        if self.hpz is not None and self.hpz.holds(slot):
            handle = self.hpz.gather(slot, full)
        else:
            self.shard.fill(unit, unit.piece(full, self.rank))
            handle = self.comm.all_gather(full, compute_copy=True, unit=slot, used=unit.layout.used)
            if self.hpz is not None:
                self._full_gathers[slot] = self.hpz.generation  # kept when it lands, unless stale by then
        for param, view in zip(unit.params, self.views[slot]):
            param.data = view
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())
        return handle

    def landed(self, slot: int) -> None:
        """hpZ: keep the node-group piece of a unit gathered from every rank, unless stale since."""
        if self.hpz is not None and self._full_gathers.pop(slot, None) == self.hpz.generation:
            self.hpz.keep(slot, self.full[slot])

    def free(self, slot: int) -> None:
        self.blocks.take(self.full[slot].untyped_storage())
        # a stray read of a released parameter is then an empty tensor, not freed memory; tensors
        # autograd saved keep the resizable storage and see the data again once re-gathered
        for param in self.units[slot].params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    def drop_idle_blocks(self) -> None:
        """Hand back the memory of released units kept for re-gathers (at the end of a backward)."""
        self.blocks.drop_idle()

    def gathered_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.full)
