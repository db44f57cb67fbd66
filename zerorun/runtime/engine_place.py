"""Where the engine's caller stands: the place every collective's tag carries (comm/places.py says why).

The engine's phase says forward, backward or step; torch's grad mode tells a training forward from an evaluation
(a forward under `no_grad` outside `engine.backward`); what else the engine is doing (setting up, a state dict,
a checkpoint, `gathered()`) is said by the engine around those calls; the counters are the engine's own, read at
each collective, never copied. A forward called on the module itself (not through the engine) is placed the same
way, since stage 3's hooks gather for it all the same.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import AbstractContextManager, contextmanager
from typing import Iterator, Protocol, Sequence

import torch
from torch import nn

from zerorun.runtime.accumulation import AccumulationWindow
from zerorun.runtime.comm.collectives import Collectives
from zerorun.runtime.comm.places import Activity, Place, UnitNames
from zerorun.runtime.phase import Phase, TrainingPhase
from zerorun.runtime.store import ParamStore, master_state_dict

__all__ = ["Activity", "EnginePlace", "unit_name"]
_PHASES = {Phase.BACKWARD: Activity.BACKWARD, Phase.STEP: Activity.STEP}


class Counters(Protocol):
    """The engine's counters a place reports."""

    global_step: int
    micro_steps: int
    window: AccumulationWindow


class EnginePlace:
    """One engine's `PlaceSource`: its phase, counters and current activity, and its units' names."""

    def __init__(self, phase: TrainingPhase, counters: Counters, comm: Collectives) -> None:
        """Tells `comm` (and whatever shares its tags) to ask this place at every collective. The counters are held
        weakly: the model's hooks reach the collectives, and must not keep the engine alive (interop's undo runs
        when it is collected)."""
        self._phase, self._counters = phase, weakref.ref(counters)
        self._tags = comm.tags
        if comm.tags is not None:
            comm.tags.places = self
        self._doing: list[Activity] = [Activity.SETUP]  # until the engine is built
        self.names = UnitNames()

    def place(self) -> Place:
        activity = self._doing[-1] if self._doing else _PHASES.get(self._phase.now)
        if activity is None:
            activity = Activity.FORWARD if torch.is_grad_enabled() else Activity.NO_GRAD_FORWARD
        if activity is Activity.SETUP:  # the counters do not exist yet
            return Place(activity)
        engine = self._counters()
        if engine is None:
            return Place(activity)
        return Place(activity, engine.global_step, engine.micro_steps, engine.window.backwards)

    @contextmanager
    def doing(self, activity: Activity) -> Iterator[None]:
        """Collectives inside are placed as `activity` (a state dict, a checkpoint, ...)."""
        self._doing.append(activity)
        try:
            yield
        finally:
            self._doing.pop()

    @contextmanager
    def around(self, activity: Activity, inner: AbstractContextManager) -> Iterator[None]:
        """`inner`'s entry and exit placed as `activity`; the caller's block between them placed as it is."""
        with self.doing(activity):
            inner.__enter__()
        try:
            yield
        except BaseException:
            with self.doing(activity):
                if not inner.__exit__(*sys.exc_info()):
                    raise
        else:
            with self.doing(activity):
                inner.__exit__(None, None, None)

    def last_collective(self) -> str | None:
        """Where this rank was at its latest collective (the stall report says it), or None before the first."""
        last = self._tags.last if self._tags is not None else None
        return last.describe(self.names) if last is not None else None

    def gathered_state(self, store: ParamStore, comm: Collectives, module: nn.Module) -> dict[str, torch.Tensor]:
        """The trainable parameters' fp32 masters by name, gathered on every rank (the model's own state dict)."""
        with self.doing(Activity.STATE_DICT):
            full = master_state_dict(module, store, comm, every_rank=True)
        names = {name for name, p in nn.Module.named_parameters(module, remove_duplicate=False) if p.requires_grad}
        return {name: value for name, value in full.items() if name in names}

    def built(self, model: nn.Module, units: Sequence[Sequence[nn.Parameter]]) -> None:
        """Setup is over: name the units (each by the parameters it holds) for the messages."""
        names = {id(p): name for name, p in nn.Module.named_parameters(model, remove_duplicate=False)}
        self.names.names = [unit_name([names.get(id(p), "?") for p in params]) for params in units]
        self._doing.remove(Activity.SETUP)


def unit_name(param_names: Sequence[str]) -> str:
    """A unit named by its parameters: the module that holds them all (`blocks.2`), else its first and last."""
    if not param_names:
        return "(empty)"
    modules = [name.split(".")[:-1] for name in param_names]
    common: list[str] = []
    for parts in zip(*modules):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    if common:
        return ".".join(common)
    return param_names[0] if len(param_names) == 1 else f"{param_names[0]} + {len(param_names) - 1} more"
