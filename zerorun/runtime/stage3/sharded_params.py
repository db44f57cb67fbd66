"""Stage 3's parameter store: parameters live as this rank's shard and are gathered around their use.

The store holds the parameter shard (`param_shards.py`: the master itself, a compute-dtype tensor,
or NVMe files), this rank's optimizer state, and the `UnitBuffers` (unit_buffers.py) every unit is
gathered into. Each module unit's state and transitions are its `UnitGroup`'s (unit_group.py), bound
to those buffers, not to the store; when a group gathers and releases is the scheduler's
(param_scheduler.py). With hpZ (hpz.py) a unit whose node-group piece is still valid is gathered
within the node.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

from zerorun.runtime.comm.collectives import Collectives, Pending
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.offload.homes import MASTER
from zerorun.runtime.offload.placement import Placement
from zerorun.runtime.precision import PrecisionPolicy
from zerorun.runtime.ranges import Ranges
from zerorun.runtime.stage3.hpz import SecondaryPartition
from zerorun.runtime.stage3.module_units import Stage3Plan
from zerorun.runtime.stage3.param_shards import build_param_shard
from zerorun.runtime.stage3.sharded_init import InitLog, materialize
from zerorun.runtime.stage3.unit_buffers import UnitBuffers
from zerorun.runtime.stage3.unit_group import AROUND_USE, UnitState
from zerorun.runtime.store import ParamIO, UpdateTarget, master_state_dict, saved_masters, units_of
from zerorun.runtime.units import Unit


class ShardedParams:
    """The stage 3 `ParamStore`: a parameter shard per rank, unit buffers gathered on demand."""

    def __init__(self, model: nn.Module, plan: Stage3Plan, placement: Placement, policy: PrecisionPolicy,
                 comm: Collectives, init_log: InitLog | None = None,
                 hpz: SecondaryPartition | None = None, state_kinds: list[tuple[str, ...]] | None = None,
                 ranges: Ranges | None = None) -> None:
        self.policy, self.comm, self.device = policy, comm, placement.device
        self.hpz = hpz  # the secondary copy within the node; None: every gather is from every rank
        self.shard_world, self.shard_rank = comm.world_size, comm.rank
        self.plan, self.units, self.group_numels = plan, plan.units, plan.group_numels
        self.groups, self.persistent = plan.groups, plan.persistent
        starts = [[u.state_offset for u in units_of(self.units, g)] for g in range(len(self.group_numels))]
        self.home = placement.optimizer_home(self.group_numels, unit_starts=starts, state_kinds=state_kinds)
        self.shard = build_param_shard(placement, self.home, self.units, self.group_numels, policy.param_dtype)
        self.buffers = UnitBuffers(self.units, self.shard, comm, hpz, policy.param_dtype, self.device)
        if init_log is not None:
            self._shard_from_replay(init_log)
        else:
            self._shard_from(model)
        for k in range(len(self.units)):
            self.buffers.free(k)
        for group in self.groups:
            group.bind(self.buffers, ranges or Ranges())
        self.persistent.ensure_gathered()

    # -- the first values -------------------------------------------------------------------------
    def _set_piece(self, group: int, start: int, values: torch.Tensor) -> None:
        """Elements from `start` of this rank's fp32 master (and of the shard gathers read) for `group`."""
        self.home.write(group, MASTER, values, start=start)
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

    def settle(self) -> None:
        for group in self.groups:  # a prefetch for the next forward (`overlap_comm`) may still be in flight
            if group.state is UnitState.GATHERING:
                group.finish_gather()

    def saved_master(self) -> dict[str, torch.Tensor]:
        return saved_masters(self.home, len(self.group_numels))

    def restore_master(self, group: int, values: torch.Tensor) -> None:
        self.home.write(group, MASTER, values)
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
        return master_state_dict(module, self, self.comm, every_rank=False)

    def unit_count(self) -> int:
        return len(self.plan.gathered_units())

    def param_io(self) -> ParamIO:
        return self.shard.io()

    def account(self, report: MemoryReport) -> None:
        window = {k for group in self.groups if group.kind in AROUND_USE for k in group.slots}
        held = [(k in window, t.untyped_storage().nbytes()) for k, t in enumerate(self.buffers.full)]
        secondary = self.hpz.nbytes() if self.hpz is not None else 0
        report.add("params", self.device.type, sum(n for in_window, n in held if not in_window) + secondary)
        idle = self.buffers.blocks.idle_bytes()  # released units' memory, kept for reuse
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
        group.pinned += 1  # what runs inside (a forward on one rank) leaves it gathered: no collective of its own
    try:
        yield
    finally:
        for group in chosen:
            group.pinned -= 1
            for k, unit in zip(group.slots, group.units) if modify else []:
                full = store.buffers.full[k]
                store.comm.broadcast(full, src=src).wait()
                store.set_piece(unit, unit.piece(full, store.shard_rank))
        for group in released:
            if not group.pinned:
                group.release_if_held()
