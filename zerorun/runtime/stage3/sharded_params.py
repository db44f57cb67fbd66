"""Stage 3's parameter store: parameters live as this rank's shard and are gathered around their use.

Each unit has a gathered buffer whose storage is emptied when released and given memory again when
gathered, so the module's parameters (views into it) and tensors autograd saved during forward
stay valid across release and re-gather. The memory comes from a `BlockCache` (memory.py) on the
host, and from the allocator (`resize_`) on CUDA, whose caching allocator keeps freed blocks
itself. A gather fills this rank's piece from the parameter shard (`param_shards.py`: the master
itself, a compute-dtype tensor, or NVMe files) and all-gathers the rest; with hpZ (hpz.py), a unit
whose node-group piece is still valid is gathered within the node instead. The transitions of a
module unit (module_units.py) are strict; `ensure_gathered`, `prefetch` and `release_if_held` are
the forgiving forms the scheduler uses where more than one state is legitimate. When to call them is the scheduler's business (param_scheduler.py).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Iterable, Iterator

import torch
from torch import nn

from zerorun.runtime.comm.collectives import Collectives, Pending
from zerorun.runtime.stage3.hpz import SecondaryPartition
from zerorun.runtime.memory import MemoryReport, gather_blocks
from zerorun.runtime.stage3.module_units import AROUND_USE, ModuleUnit, Stage3Plan, UnitState
from zerorun.runtime.stage3.param_shards import build_param_shard
from zerorun.runtime.offload.placement import Placement
from zerorun.runtime.precision import PrecisionPolicy
from zerorun.runtime.stage3.sharded_init import InitLog, materialize
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
        self.module_units, self.persistent = plan.module_units, plan.persistent
        self.home = placement.optimizer_home(self.group_numels)
        self.shard = build_param_shard(placement, self.home, self.units, self.group_numels, policy.param_dtype)
        self.full = [torch.empty(u.padded_numel, dtype=policy.param_dtype, device=self.device) for u in self.units]
        self.views = [[self.full[k][span.offset:span.end].view(shape) for span, shape in zip(u.layout.spans, u.shapes)]
                      for k, u in enumerate(self.units)]
        self.peak_gathered_bytes = 0
        if init_log is not None:
            self._shard_from_replay(init_log)
        else:
            self._shard_from(model)
        for k in range(len(self.units)):
            self.full[k].untyped_storage().resize_(0)  # never used: back to the allocator, not into `blocks`
            self._free(k)
        self.start_gather(self.persistent)
        self.finish_gather(self.persistent)

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

    # -- the state machine: strict transitions ------------------------------------------------
    def start_gather(self, mu: ModuleUnit) -> None:
        """RELEASED -> GATHERING: this rank's pieces into place, the all-gathers launched."""
        mu.expect(UnitState.RELEASED)
        handles = []
        for k in mu.units:
            unit, full = self.units[k], self.full[k]
            self._allocate(k)
            if self.hpz is not None and self.hpz.holds(k):
                handles.append(self.hpz.gather(k, full))
            else:
                self.shard.fill(unit, unit.piece(full, self.shard_rank))
                handles.append(self.comm.all_gather(full, compute_copy=True))
                if self.hpz is not None:
                    self._full_gathers[k] = self.hpz.generation  # kept when it lands, unless stale by then
            for param, view in zip(unit.params, self.views[k]):
                param.data = view
        mu.pending, mu.state = Pending(handles), UnitState.GATHERING
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())

    def finish_gather(self, mu: ModuleUnit) -> None:
        """GATHERING -> GATHERED: wait for the all-gathers."""
        mu.expect(UnitState.GATHERING)
        assert mu.pending is not None, "a GATHERING unit has its all-gathers pending"
        mu.pending.wait()
        mu.pending, mu.state = None, UnitState.GATHERED
        if self.hpz is not None:
            self._keep_secondary(mu, self.hpz)

    def _keep_secondary(self, mu: ModuleUnit, hpz: SecondaryPartition) -> None:
        """hpZ: keep the node-group pieces of `mu`'s units gathered from every rank, unless stale since."""
        for k in mu.units:
            if self._full_gathers.pop(k, None) == hpz.generation:
                hpz.keep(k, self.full[k])

    def release(self, mu: ModuleUnit) -> None:
        """GATHERED -> RELEASED: free the buffers (never while a collective writes into them)."""
        mu.expect(UnitState.GATHERED)
        for k in mu.units:
            self._free(k)
        mu.state = UnitState.RELEASED

    def _allocate(self, k: int) -> None:
        self.blocks.fill(self.full[k].untyped_storage(), self.full[k].numel() * self.full[k].element_size())

    def _free(self, k: int) -> None:
        self.blocks.take(self.full[k].untyped_storage())
        # a stray read of a released parameter is then an empty tensor, not freed memory; tensors
        # autograd saved keep the resizable storage and see the data again once re-gathered
        for param in self.units[k].params:
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    # -- forgiving forms, for callers where several states are legitimate ---------------------------
    def ensure_gathered(self, mu: ModuleUnit) -> None:
        """Whatever its state, return with `mu` GATHERED."""
        if mu.state is UnitState.RELEASED:
            self.start_gather(mu)
        if mu.state is UnitState.GATHERING:
            self.finish_gather(mu)

    def prefetch(self, mu: ModuleUnit) -> None:
        """Start gathering `mu` if it is released (a prefetch of a unit already there is a no-op)."""
        if mu.state is UnitState.RELEASED:
            self.start_gather(mu)

    def release_if_held(self, mu: ModuleUnit) -> None:
        """Whatever its state, return with `mu` RELEASED (an in-flight gather is finished first)."""
        if mu.state is UnitState.GATHERING:
            self.finish_gather(mu)
        if mu.state is UnitState.GATHERED:
            self.release(mu)

    def drop_idle_blocks(self) -> None:
        """Hand back the memory of released units kept for re-gathers (at the end of a backward)."""
        self.blocks.drop_idle()

    # -- the ParamStore interface -------------------------------------------------------------------
    def update_targets(self, group: int) -> list[UpdateTarget]:
        return [self.shard.target(u) for u in units_of(self.units, group)]

    def publish(self) -> Pending:
        """After a step: refresh the units gathered right now (the persistent one; the rest gather later)."""
        live = [mu for mu in self.module_units if mu.state is not UnitState.RELEASED]
        for mu in live:
            self.release_if_held(mu)
        self._parameters_changed()
        for mu in live:
            self.start_gather(mu)

        def gather_live() -> None:
            for mu in live:
                self.ensure_gathered(mu)
        return Pending(then=gather_live)

    def publish_after_step(self) -> None:
        self.publish().wait()

    def wait_published(self) -> None:
        pass  # `publish_after_step` waited for the units gathered then; the rest gather when used

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
        window = {k for mu in self.module_units if mu.kind in AROUND_USE for k in mu.units}
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
    chosen = [mu for mu in store.module_units
              if wanted is None or any(p in wanted for k in mu.units for p in store.units[k].params)]
    released = [mu for mu in chosen if mu.state is UnitState.RELEASED]
    for mu in chosen:
        store.prefetch(mu)
    for mu in chosen:
        store.ensure_gathered(mu)
    try:
        yield
    finally:
        for mu in chosen:
            for k in mu.units if modify else []:
                store.comm.broadcast(store.full[k], src=src).wait()
                store.set_piece(store.units[k], store.units[k].piece(store.full[k], store.shard_rank))
        for mu in released:
            store.release(mu)
