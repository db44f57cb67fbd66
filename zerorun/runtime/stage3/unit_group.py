"""A stage 3 module unit's life, owned by one object, as FSDP2's `FSDPParamGroup` owns a group's.

A `UnitGroup` is one module unit of the plan (module_units.py): a module (or the root, or the
persistent parameters), its kind, and its flat units (units.py), each one all-gather and one
reduce-scatter. The group holds where it is and moves itself between states, only along

    RELEASED --start_gather--> GATHERING --finish_gather--> GATHERED --release--> RELEASED

Every transition asserts where it starts (`expect`, like FSDP2's `_assert_in_states`): a hook
firing in an order nobody planned is a loud bug, not a silent repair. `ensure_gathered`, `prefetch`
and `release_if_held` are the forgiving forms, for callers where more than one state is legitimate
(a prefetched unit, a unit called twice).

The group also ends its own backward, as FSDP2's `post_backward`: a post-accumulate-grad hook on
each of its parameters hands the gradient to the reducer (`UnitReducer.accept`), and as soon as one
of its units has all its gradients the group launches that unit's reduce-scatter itself; once all
have gone, it releases its parameters (unless the pass keeps it whole, `whole_pass`). Nobody is
called back: the reducer stages and reduces, the group decides when.

What a gather *does* to memory and the wire (a buffer filled from the shard, an all-gather or hpZ's
gather within the node, the parameters pointed at the buffer) is the `UnitBuffers`'
(unit_buffers.py), through the three calls of `GatherBuffers`; *when* a group gathers in forward and
backward is the scheduler's (param_scheduler.py), which alone sees the order of the pass.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import Protocol

from torch import nn
from torch.utils.hooks import RemovableHandle

from zerorun.runtime.comm.collectives import Handle, Pending
from zerorun.runtime.ranges import Ranges
from zerorun.runtime.units import Unit


class UnitKind(Enum):
    WRAPPED = "wrapped"
    SPLIT = "split"  # a module outside every wrapped one, split off the root (module_units.py)
    ROOT = "root"
    PERSISTENT = "persistent"


AROUND_USE = (UnitKind.WRAPPED, UnitKind.SPLIT)  # the kinds gathered around their use, not for the whole pass


class UnitState(Enum):
    RELEASED = "released"  # storage freed; parameters are empty tensors
    GATHERING = "gathering"  # this rank's pieces in place, all-gather in flight
    GATHERED = "gathered"  # full parameters, safe to compute with


class GatherBuffers(Protocol):
    """What a group asks of the store that holds its units' buffers, by a unit's slot in the plan."""

    def gather(self, slot: int) -> Handle:
        """Give the slot's buffer memory, put this rank's piece in place, point the parameters at it and
        start the gather of the rest."""

    def landed(self, slot: int) -> None:
        """The slot's gather has finished (hpZ may keep a copy of it)."""

    def free(self, slot: int) -> None:
        """Hand the slot's buffer memory back; its parameters become empty tensors."""


class UnitReducer(Protocol):
    """What a group asks of the gradient reducer (grad_reducer.py), by a unit's slot in the plan."""

    def accept(self, param: nn.Parameter) -> int | None:
        """Take `param`'s fresh gradient out of `param.grad`; its unit's slot, or None while it is only held."""

    def launches_now(self, slot: int) -> bool:
        """Whether the unit at `slot` has all its gradients and this backward reduces them as they complete."""

    def launch(self, slot: int) -> None:
        """Start the unit's reduce-scatter."""


class UnitGroup:
    """Parameters gathered and released together, with the state they are in."""

    def __init__(self, name: str, module: nn.Module, kind: UnitKind) -> None:
        self.name, self.module, self.kind = name, module, kind
        self.units: list[Unit] = []  # its flat units, in optimizer-state order
        self.slots: list[int] = []  # their positions in the plan's units: the store's buffers, the reducer's index
        self.state = UnitState.RELEASED
        self.pending: Pending | None = None  # the all-gathers of a GATHERING group
        self._buffers: GatherBuffers | None = None
        self.ranges = Ranges()  # the runtime's, once bound: its gathers in a profile's trace
        self._reducer: UnitReducer | None = None
        self._grad_hooks: list[RemovableHandle] = []
        self._sent: set[int] = set()  # slots whose reduce-scatter this group launched in this backward
        self.whole_pass = kind is UnitKind.SPLIT  # kept gathered for the whole pass (the scheduler's first pass decides)
        # inside engine.gathered(): kept gathered, whatever runs inside (a forward on rank 0 alone issues no collective)
        self.pinned = 0

    def __repr__(self) -> str:
        return f"UnitGroup({self.name!r}, {self.kind.value}, {self.state.value}, {len(self.units)} units)"

    def add(self, slot: int, unit: Unit) -> None:
        self.slots.append(slot)
        self.units.append(unit)

    def bind(self, buffers: GatherBuffers, ranges: Ranges) -> None:
        """The buffers this group's gathers fill, and the ranges they are named in (once, when the store is built)."""
        self._buffers, self.ranges = buffers, ranges

    def reduce_with(self, reducer: UnitReducer) -> None:
        """Reduce this group's gradients through `reducer` as backward produces them (once, at setup)."""
        self._reducer = reducer
        self._grad_hooks = [p.register_post_accumulate_grad_hook(self._gradient_arrived) for p in self.params]

    def remove_hooks(self) -> None:
        for hook in self._grad_hooks:
            hook.remove()
        self._grad_hooks = []

    @property
    def params(self) -> list[nn.Parameter]:
        return [p for unit in self.units for p in unit.params]

    @functools.cached_property
    def one_sided(self) -> bool:
        """Its gather goes one way only: its owner-run units (whole parameters per piece) hold parameters in one
        rank's piece and no other (a module of one matrix run by Muon, say an embedding); asked once the plan is
        built, which never changes."""
        ranks = {span.offset // unit.layout.shard_numel for unit in self.units if unit.layout.whole
                 for span in unit.layout.spans if span.numel}
        return len(ranks) == 1 and any(unit.layout.world_size > 1 for unit in self.units)

    @property
    def numel(self) -> int:
        return sum(unit.layout.numel for unit in self.units)

    def expect(self, *states: UnitState) -> None:
        assert self.state in states, (f"stage 3 unit {self.name}: expected {' or '.join(s.value for s in states)}, "
                                      f"but it is {self.state.value}")

    # -- strict transitions ---------------------------------------------------------------------------
    def start_gather(self) -> None:
        """RELEASED -> GATHERING: this rank's pieces into place, the all-gathers launched."""
        self.expect(UnitState.RELEASED)
        buffers = self._bound()
        with self.ranges.named("all-gather"):
            self.pending, self.state = Pending([buffers.gather(k) for k in self.slots]), UnitState.GATHERING

    def finish_gather(self) -> None:
        """GATHERING -> GATHERED: wait for the all-gathers."""
        self.expect(UnitState.GATHERING)
        assert self.pending is not None, "a GATHERING unit has its all-gathers pending"
        with self.ranges.named("all-gather wait"):
            self.pending.wait()
        self.pending, self.state = None, UnitState.GATHERED
        for k in self.slots:
            self._bound().landed(k)

    def release(self) -> None:
        """GATHERED -> RELEASED: free the buffers (never while a collective writes into them)."""
        self.expect(UnitState.GATHERED)
        for k in self.slots:
            self._bound().free(k)
        self.state = UnitState.RELEASED

    def _bound(self) -> GatherBuffers:
        assert self._buffers is not None, f"stage 3 unit {self.name} is not bound to a store"
        return self._buffers

    # -- forgiving forms --------------------------------------------------------------------------------
    def ensure_gathered(self) -> None:
        """Whatever its state, return GATHERED."""
        if self.state is UnitState.RELEASED:
            self.start_gather()
        if self.state is UnitState.GATHERING:
            self.finish_gather()

    def prefetch(self) -> None:
        """Start gathering if released (a prefetch of a group already there is a no-op)."""
        if self.state is UnitState.RELEASED:
            self.start_gather()

    def release_if_held(self) -> None:
        """Whatever its state, return RELEASED (an in-flight gather is finished first); a pinned group stays."""
        if self.pinned:
            return
        if self.state is UnitState.GATHERING:
            self.finish_gather()
        if self.state is UnitState.GATHERED:
            self.release()

    # -- gradients ----------------------------------------------------------------------------------------
    def _gradient_arrived(self, param: nn.Parameter) -> None:
        """A parameter's gradient is accumulated: hand it over; launch a unit it completes; once every unit's
        reduce-scatter is out, release the parameters (this backward needs them no more)."""
        assert self._reducer is not None, f"stage 3 unit {self.name} has no reducer"
        slot = self._reducer.accept(param)
        if slot is None or not self._reducer.launches_now(slot):
            return
        self._reducer.launch(slot)
        self._sent.add(slot)
        if self.all_sent and self.kind in AROUND_USE and not self.whole_pass:
            self.release_if_held()  # (already released if nothing gathered it again for this backward)

    @property
    def all_sent(self) -> bool:
        """Every unit's gradients went out in this backward (a gradient hook firing now is a late one)."""
        return bool(self.slots) and len(self._sent) == len(self.slots)

    def end_backward(self) -> None:
        self._sent.clear()
