"""Stage 3's parameter store: parameters live as this rank's shard and are gathered around their use.

Each unit has a gathered buffer whose storage is emptied when released and given memory again when
gathered, so the module's parameters (views into it) and tensors autograd saved during forward
stay valid across release and re-gather. The memory comes from a `BlockCache` (memory.py) on the
host, and from the allocator (`resize_`) on CUDA, whose caching allocator keeps freed blocks
itself. A gather fills this rank's piece from the parameter shard (`param_shards.py`: the master
itself, a compute-dtype tensor, or NVMe files) and all-gathers the rest; with hpZ (hpz.py), a unit
whose node-group piece is still valid is gathered within the node instead. That is all the store does
for a gather (`GatherBuffers`): each module unit's state and transitions are its `UnitGroup`'s
(unit_group.py), and when a group gathers and releases is the scheduler's (param_scheduler.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterable, Iterator

import torch
from torch import nn

from zerorun.runtime.comm.collectives import Collectives, Handle, Pending
from zerorun.runtime.memory import MemoryReport, gather_blocks
from zerorun.runtime.offload.placement import Placement
from zerorun.runtime.precision import PrecisionPolicy
from zerorun.runtime.stage3.hpz import SecondaryPartition
from zerorun.runtime.stage3.module_units import Stage3Plan
from zerorun.runtime.stage3.param_shards import build_param_shard
from zerorun.runtime.stage3.sharded_init import InitLog, materialize
from zerorun.runtime.stage3.unit_group import AROUND_USE, UnitState
from zerorun.runtime.store import ParamIO, UpdateTarget, master_state_dict, units_of
from zerorun.runtime.units import Unit


class ShardedParams:
    """The stage 3 `ParamStore`: a parameter shard per rank, unit buffers gathered on demand."""

    def __init__(self, model: nn.Module, plan: Stage3Plan, placement: Placement, policy: PrecisionPolicy,
                 comm: Collectives, init_log: InitLog | None = None,
                 hpz: SecondaryPartition | None = None) -> None:
        self.policy, self.comm, self.device = policy, comm, placement.device
        self.hpz = hpz  # the secondary copy within the node; None: every gather is from every rank
        self._full_gathers: dict[int, int] = {}  # unit -> hpz generation when its gather from every rank began
        self.blocks = gather_blocks(self.device)  # where gathered buffers get their memory
        self.shard_world, self.shard_rank = comm.world_size, comm.rank
        self.plan, self.units, self.group_numels = plan, plan.units, plan.group_numels
        self.groups, self.persistent = plan.groups, plan.persistent
        starts = [[u.state_offset for u in units_of(self.units, g)] for g in range(len(self.group_numels))]
        self.home = placement.optimizer_home(self.group_numels, unit_starts=starts)
        self.shard = build_param_shard(placement, self.home, self.units, self.group_numels, policy.param_dtype)
        # each unit's gathered buffer and its parameters' views, made one unit at a time and emptied at once: all of
        # them at once would hold the whole model in the compute dtype beside the model the script built
        self.full: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        for u in self.units:
            full = torch.empty(u.padded_numel, dtype=policy.param_dtype, device=self.device)
            self.views.append([full[span.offset:span.end].view(shape) for span, shape in zip(u.layout.spans, u.shapes)])
            full.untyped_storage().resize_(0)  # never used: back to the allocator, not into `blocks`
            self.full.append(full)
        self.peak_gathered_bytes = 0
        if init_log is not None:
            self._shard_from_replay(init_log)
        else:
            self._shard_from(model)
        for k in range(len(self.units)):
            self.free(k)
        for group in self.groups:
            group.bind(self)
        self.persistent.ensure_gathered()

    # -- the first values -------------------------------------------------------------------------
    def _set_piece(self, group: int, start: int, values: torch.Tensor) -> None:
        """Elements from `start` of this rank's fp32 master (and of the shard gathers read) for `group`."""
        self.home.write(group, "master", values, start=start)
        self.shard.write(group, start, values)
        self._parameters_changed()

    def _shard_from(self, model: nn.Module) -> None:
        """Keep this rank's pieces of rank 0's parameter values, one unit at a time."""
        for unit in self.units:
            full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=self.device)
            for span, param in zip(unit.layout.spans, unit.params):
                full[span.offset:span.end].copy_(param.detach().reshape(-1))
            self.comm.broadcast(full, src=0).wait()
            self._set_piece(unit.group, unit.state_offset, unit.piece(full, self.shard_rank))

    def _shard_from_replay(self, log: InitLog) -> None:
        """Replay a `sharded_init` log, keeping only this rank's pieces (every rank computes the same values)."""
        place = {param: (unit, i) for unit in self.units for i, param in enumerate(unit.params)}

        def keep(param: nn.Parameter, value: torch.Tensor) -> None:
            if param not in place:  # frozen: stays whole
                materialize(param, value)
                return
            unit, index = place[param]
            piece = unit.layout.piece_of(index, self.shard_rank)
            if piece is not None:
                values = value.reshape(-1)[piece.param_start:piece.param_start + piece.numel].float()
                self._set_piece(unit.group, unit.state_offset + piece.shard_start, values)

        log.replay(keep, self.device)
        for unit in self.units:
            for param in unit.params:
                if param.is_meta:  # becomes a real (empty until gathered) parameter
                    materialize(param, torch.empty(0, dtype=self.policy.param_dtype, device=self.device))

    # -- a gather's memory and collectives (`GatherBuffers`, for the unit groups) ----------------------
    def gather(self, slot: int) -> Handle:
        unit, full = self.units[slot], self.full[slot]
        self.blocks.fill(full.untyped_storage(), full.numel() * full.element_size())
        if self.hpz is not None and self.hpz.holds(slot):
            handle = self.hpz.gather(slot, full)
        else:
            self.shard.fill(unit, unit.piece(full, self.shard_rank))
            handle = self.comm.all_gather(full, compute_copy=True)
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

    # -- the ParamStore interface -------------------------------------------------------------------
    def update_targets(self, group: int) -> list[UpdateTarget]:
        return [self.shard.target(u) for u in units_of(self.units, group)]

    def publish(self) -> Pending:
        """After a step: refresh the units gathered right now (the persistent one; the rest gather later)."""
        live = [group for group in self.groups if group.state is not UnitState.RELEASED]
        for group in live:
            group.release_if_held()
        self._parameters_changed()
        for group in live:
            group.start_gather()

        def gather_live() -> None:
            for group in live:
                group.ensure_gathered()
        return Pending(then=gather_live)

    def publish_after_step(self) -> None:
        self.publish().wait()

    def wait_published(self) -> None:
        pass  # `publish_after_step` waited for the units gathered then; the rest gather when used

    def settle(self) -> None:
        for group in self.groups:  # a prefetch for the next forward (`overlap_comm`) may still be in flight
            if group.state is UnitState.GATHERING:
                group.finish_gather()

    def forward_context(self) -> AbstractContextManager:
        return nullcontext()  # no scheduler: the caller gathers and releases (`ScheduledParams` has one)

    def begin_backward(self) -> None:
        pass

    def end_backward(self) -> None:
        pass

    def master_changed(self, group: int, values: torch.Tensor) -> None:
        self.shard.write(group, 0, values)
        self._parameters_changed()

    def _parameters_changed(self) -> None:
        if self.hpz is not None:
            self.hpz.invalidate()  # the secondary copies hold the old values

    def set_piece(self, unit: Unit, values: torch.Tensor) -> None:
        """Overwrite this rank's piece of `unit` (master and shard) with `values`."""
        self._set_piece(unit.group, unit.state_offset, values.float())

    def gathered(self, params: Iterable[nn.Parameter] | None = None, modify: bool = False,
                 src: int = 0) -> AbstractContextManager:
        return _gathered(self, params, modify, src)

    def full_state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        return master_state_dict(module, self, every_rank=False)

    def unit_count(self) -> int:
        return len(self.plan.gathered_units())

    def gathered_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.full)

    def param_io(self) -> ParamIO:
        return self.shard.io()

    def account(self, report: MemoryReport) -> None:
        window = {k for group in self.groups if group.kind in AROUND_USE for k in group.slots}
        held = [(k in window, t.untyped_storage().nbytes()) for k, t in enumerate(self.full)]
        secondary = self.hpz.nbytes() if self.hpz is not None else 0
        report.add("params", self.device.type, sum(n for in_window, n in held if not in_window) + secondary)
        idle = self.blocks.idle_bytes()  # released units' memory, kept for reuse
        report.add("gathered", self.device.type, sum(n for in_window, n in held if in_window) + idle)
        self.shard.account(report)
        report.units = self.unit_count()


@contextmanager
def _gathered(store: ShardedParams, params: Iterable[nn.Parameter] | None, modify: bool, src: int) -> Iterator[None]:
    """Full parameters inside the block; with `modify`, rank `src`'s values are written back to every shard."""
    wanted = set(params) if params is not None else None
    chosen = [group for group in store.groups if wanted is None or any(p in wanted for p in group.params)]
    released = [group for group in chosen if group.state is UnitState.RELEASED]
    for group in chosen:
        group.prefetch()
    for group in chosen:
        group.ensure_gathered()
    try:
        yield
    finally:
        for group in chosen:
            for k, unit in zip(group.slots, group.units) if modify else []:
                store.comm.broadcast(store.full[k], src=src).wait()
                store.set_piece(unit, unit.piece(store.full[k], store.shard_rank))
        for group in released:
            group.release()
