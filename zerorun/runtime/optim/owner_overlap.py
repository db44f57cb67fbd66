"""The owner way under the backward (`zero.overlap_optimizer`): each unit's owned parameters stepped as soon as
their gradients are final, speculatively, exactly.

overlap.py updates the fused Adam groups on the host under the window's last backward; this module does the same
for the owner way (owner_step.py). When unit k's reduce-scatter lands, the parameters of it this rank owns are whole
here, so the overlap's worker thread steps them (Muon's Newton-Schulz, Adafactor's factored moments, ...) while the
backward goes on: on the device where there is one, their state brought from the host and sent back there
(`OwnedHost`) under the backward too.

    unit k reduced --> worker: back up the owned parameters' master values and optimizer state,
                               step them (the script's optimizer, over them alone),
                               their new values to the master and the stage's parameters

The speculation assumes what the fused one does (no clip, no skip, the hyper-parameters as they were) and one
thing more: that stepping an optimizer unit by unit is stepping it once. The owner way already asks that a
parameter's update depend on that parameter alone (ways.py); what it cannot see is state kept beside the
parameters: a param group entry a step changes (`group["step"] += 1`) or a counter of the optimizer's own. So
each unit's step runs on copies of the param groups, and the optimizer's own numbers are compared from its first
call to its last. Where either changed, the speculation is rolled back ("whole") and that optimizer steps once,
after the backward, from then on. A rollback restores each stepped parameter's master values and state from the
backup, then the stage's parameters from the restored master: bit for bit as `overlap_optimizer: false`
(tests/runtime/test_overlap_optimizer.py).
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zerorun.runtime.memory import tensor_bytes
from zerorun.runtime.optim.owner_step import OwnerParam, OwnerStep

Optimizer = torch.optim.Optimizer


@dataclass
class OwnedSteps:
    """One window's speculative steps of owned parameters: what they assumed, and what they changed."""

    divisor: float
    stepped: list[OwnerParam] = field(default_factory=list)  # backed up, then stepped, in order
    hypers: dict[Optimizer, list[dict[str, Any]]] = field(default_factory=dict)  # its groups' values at its first call
    numbers: dict[Optimizer, dict[str, Any]] = field(default_factory=dict)  # its own numbers before its first call
    after_first: dict[Optimizer, dict[str, Any]] = field(default_factory=dict)  # ... and after it
    calls: dict[Optimizer, int] = field(default_factory=dict)
    whole: set[Optimizer] = field(default_factory=set)  # found keeping state beyond its parameters in this window


class OwnerSpeculation:
    """Steps the owner way's units under the backward on the overlap's worker; commits or restores them."""

    def __init__(self, owner: OwnerStep, stepping: Callable[[], AbstractContextManager[None]]) -> None:
        """`stepping`: the engine's guard context for calls of a script's optimizer (`Update.stepping`)."""
        self.owner, self.stepping = owner, stepping
        self.whole: set[Optimizer] = set()  # optimizers stepped once, after the backward (module docstring)
        self.current: OwnedSteps | None = None
        self._backup: dict[OwnerParam, tuple[torch.Tensor, dict[str, Any]]] = {}  # reused from step to step
        self.stepped = 0  # parameters stepped under the backward in steps that kept them (telemetry, tests)

    @property
    def units(self) -> set[int]:
        return set(self.owner.units)

    def begin(self, divisor: float) -> None:
        self.current = OwnedSteps(divisor)

    # -- on the worker ----------------------------------------------------------------------------
    def step_unit(self, k: int) -> None:
        """Back up, then step, unit k's owned parameters (those of optimizers not stepped whole)."""
        steps = self.current
        assert steps is not None, "begin() first"
        params = [p for p in self.owner.owned_in(k) if self.owner.optimizer_of(p) not in self.whole]
        if not params:
            return
        for param in params:
            self._save(param)
        steps.stepped.extend(params)
        self.owner.run(steps.divisor, params, step=lambda optimizer, keys: self._shadow_step(steps, optimizer, keys),
                       grads_in_place=False)

    def _save(self, param: OwnerParam) -> None:
        values, state = self._backup.get(param, (None, {}))
        self._backup[param] = self.owner.master_values(param, values), _kept_copy(self.owner.state_of(param), state)

    def _shadow_step(self, steps: OwnedSteps, optimizer: Optimizer, keys: dict[int, list[torch.Tensor]]) -> None:
        """`optimizer.step()` over `keys` on copies of its param groups: what it writes there is seen, not kept."""
        real = optimizer.param_groups
        values = [{k: v for k, v in group.items() if k != "params"} for group in real]
        shadow = [{**group, "params": keys.get(i, [])} for i, group in enumerate(values)]
        first = optimizer not in steps.calls
        if first:
            steps.hypers[optimizer] = [_snapshot(group) for group in values]
            steps.numbers[optimizer] = _numbers(optimizer)
        optimizer.param_groups = shadow
        try:
            with self.stepping():
                optimizer.step()
        finally:
            optimizer.param_groups = real
        steps.calls[optimizer] = steps.calls.get(optimizer, 0) + 1
        if first:
            steps.after_first[optimizer] = _numbers(optimizer)
        if any(not _same({k: v for k, v in group.items() if k != "params"}, before)
               for group, before in zip(shadow, values, strict=True)):
            steps.whole.add(optimizer)

    # -- at step() --------------------------------------------------------------------------------
    def mismatch(self) -> str | None:
        """Why the owned steps made under the backward are not this step's (an overlap.ROLLBACK_REASONS key), beyond
        what the fused check sees (clip, skip, clamp); None: they are. Call once the worker is idle."""
        steps = self.current
        if steps is None:
            return None
        for optimizer, calls in steps.calls.items():  # a counter of its own moves at every call: seen from the 2nd
            if calls > 1 and _numbers(optimizer) != steps.after_first[optimizer]:
                steps.whole.add(optimizer)
        if steps.whole:
            self.whole |= steps.whole
            return "whole"
        for optimizer, hypers in steps.hypers.items():
            now = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            if not all(_same(a, b) for a, b in zip(now, hypers, strict=True)):
                return "hyper"
        return None

    def commit(self, divisor: float) -> None:
        """The steps made under the backward are this step's: step the owned parameters they did not (in one call
        per optimizer, as without the overlap)."""
        steps = self.current
        assert steps is not None, "begin() first"
        done = set(steps.stepped)
        self.stepped += len(done)
        rest = [p for p in self.owner.owned if p not in done]
        if rest:
            with self.stepping():
                self.owner.run(divisor, rest)
        self.current = None

    def restore(self) -> None:
        """Every stepped parameter's master values and state as they were backed up; the stage's parameters from them;
        the optimizers' own numbers as before their first call."""
        steps = self.current
        if steps is None:
            return
        by_unit: dict[int, dict[OwnerParam, torch.Tensor]] = {}
        for param in steps.stepped:
            values, state = self._backup[param]
            by_unit.setdefault(param.unit, {})[param] = values
            self.owner.set_state(param, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()})
        for k, saved in by_unit.items():
            self.owner.restore(k, saved)
        for optimizer, numbers in steps.numbers.items():
            for name, value in numbers.items():
                setattr(optimizer, name, value)
        self.current = None

    def backup_bytes(self) -> dict[str, int]:
        """The backup's bytes, by device type."""
        out: dict[str, int] = {}
        for values, state in self._backup.values():
            for t in (values, *state.values()):
                if isinstance(t, torch.Tensor):
                    out[t.device.type] = out.get(t.device.type, 0) + tensor_bytes([t])
        return out


def _kept_copy(state: dict[str, Any], kept: dict[str, Any]) -> dict[str, Any]:
    """A copy of one parameter's optimizer state, into the tensors of the last copy where they fit."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            buffer = kept.get(key)
            if isinstance(buffer, torch.Tensor) and buffer.shape == value.shape and buffer.dtype == value.dtype \
                    and buffer.device == value.device:
                out[key] = buffer.copy_(value)
            else:
                out[key] = value.detach().clone()
        else:
            out[key] = copy.deepcopy(value)
    return out


def _numbers(optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer object's own int and float attributes (a step counter of its own would be one)."""
    return {k: v for k, v in vars(optimizer).items() if type(v) in (int, float)}


def _snapshot(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's values as they are now (a tensor's values too: a script may change an lr tensor in place)."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in group.items()}


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two param groups' values are equal (tensors by value)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
                    and torch.equal(x.cpu(), y.cpu())):
                return False
        elif x is not y and x != y:
            return False
    return True
