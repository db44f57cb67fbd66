"""Stages 1/2's post-step parameter all-gather, hidden under the next forward (`zero.overlap_publish`).

After an optimizer step every rank holds only its own updated pieces of each unit; the rest of
the flat parameter buffer is stale until the unit's all-gather lands. Rather than wait for all of
them at the end of `step()`, the gathers are started in the order the next forward reads the units
and each is waited for just before the first module that reads it:

| who reads parameters                        | waits for                                        |
|---------------------------------------------|--------------------------------------------------|
| a module's forward (pre-hook, installed once) | the units of every parameter in its subtree (the root: its own parameters only) |
| `module.state_dict()` (any module's)          | everything                                       |
| the root's `parameters()` / `named_parameters()` (an EMA, a weight-norm log; runtime/interop/publish_guard.py) | everything |
| the engine's next step, backward, checkpoint save/load, `state_dict`, `gathered`, `parameters()` | everything |
| anything else (a submodule's `parameters()`, or a list of parameters taken before training, read right after `step()`) | call `engine.wait_published()` first |

The root's hook waits only for its own parameters, so a root forward that reads a child's
parameter *before* calling that child would see the previous step's value (no model here does;
set `zero.overlap_publish: false` for such a model, or call `engine.wait_published()` at the top of
its forward). Every forward ends with a wait for everything, so backward and what follows the
forward always see current values. The values are bit-identical to a synchronous publish: the same
collectives fill the same bytes, only the moment of the wait moves.

A compiled model (`torch.compile` before `initialize`) has the engine wait for everything before its
forward instead: each hook's wait would be a graph break inside it (docs/profiling-and-compiling.md).
The gathers still overlap what the script does between `step()` and the next forward.
"""

from __future__ import annotations

import os
import threading
from typing import Callable, Literal

from torch import nn
from torch.utils.hooks import RemovableHandle

from zerorun.runtime.comm.collectives import Pending
from zerorun.runtime.compiled import eager_under_compile
from zerorun.runtime.units import Unit


def publish_overlaps(setting: Literal["auto", True, False], world_size: int) -> bool:
    """Whether stages 1/2 defer the post-step all-gather (`zero.overlap_publish`).

    auto: where the data-parallel ranks span nodes. There the all-gather crosses the link, half of a
    stage 2 step's bytes, and a forward's compute can hide it (`zerorun bench step --cluster 2x1`). On one
    node the gather is a copy through shared memory or NVLink that takes less than the waits cost.
    """
    if setting != "auto":
        return bool(setting)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # the launcher's ranks on this node
    return local_world < world_size


class DeferredPublish:
    """Per-unit pending all-gathers and the module hooks that wait for them."""

    def __init__(self, root: nn.Module, units: list[Unit]) -> None:
        self._pending: dict[int, Pending] = {}
        # Waits come from the training thread (hooks, the engine) and from any other thread that reads the
        # root's parameters (the telemetry probe counts them). A unit leaves `_pending` only once its gather
        # has landed, and under this lock: a hook that finds it gone knows its values are current.
        self._lock = threading.Lock()
        self.order = _forward_order(root, units)
        self._hooks: list[RemovableHandle] = []
        for module, ks in _reads(root, units, self.order).items():
            self._hooks.append(module.register_forward_pre_hook(self._waiter(ks)))
            self._hooks.append(module.register_state_dict_pre_hook(lambda *_: self.wait_all()))
        self.deferred_waits = 0  # units first waited for by a forward hook (not by a barrier): the overlap at work

    def start(self, publish: Callable[[list[int]], dict[int, Pending]]) -> None:
        """Start every unit's gather (in forward order) through `publish`; waits happen later."""
        self.wait_all()  # a previous publish must land before its buffer is gathered into again
        started = publish(self.order)
        with self._lock:
            self._pending = started

    @property
    def outstanding(self) -> int:
        """Units whose gather has been started and not yet waited for."""
        return sum(not p.done for p in self._pending.values())

    def wait_all(self) -> None:
        """Every unit's gather landed: the whole parameter buffer is current."""
        for k in self.order:
            self._wait(k)

    def _wait(self, k: int) -> bool:
        """Wait for unit `k`'s gather if it is still pending; whether it was. Another thread waiting for the
        same unit holds the lock until the gather has landed, so this returns only once it has."""
        with self._lock:
            pending = self._pending.get(k)
            if pending is None:
                return False
            pending.wait()
            del self._pending[k]
            return True

    def _waiter(self, ks: list[int]) -> Callable[[nn.Module, object], None]:
        # Inside a compiled forward nothing is pending (the engine waits before it): dynamo traces the test of
        # `_pending` into a guard, and the waits, which take a lock, run as Python only when there are some.
        wait = eager_under_compile(self._wait_units)

        def wait_units(module: nn.Module, args: object) -> None:
            if self._pending:
                wait(ks)
        return wait_units

    def _wait_units(self, ks: list[int]) -> None:
        self.deferred_waits += sum(self._wait(k) for k in ks)

    def remove_hooks(self) -> None:
        self.wait_all()
        for hook in self._hooks:
            hook.remove()


def _forward_order(root: nn.Module, units: list[Unit]) -> list[int]:
    """Unit indices by their first parameter in registration order (the order a forward usually reads them)."""
    position = {p: i for i, p in enumerate(root.parameters())}
    return sorted(range(len(units)), key=lambda k: min(position.get(p, len(position)) for p in units[k].params))


def _reads(root: nn.Module, units: list[Unit], forward_order: list[int]) -> dict[nn.Module, list[int]]:
    """For each module holding trainable parameters: the units it waits for, in forward order."""
    unit_of = {p: k for k, unit in enumerate(units) for p in unit.params}
    order = {k: i for i, k in enumerate(forward_order)}
    reads = {}
    for module in root.modules():
        ks = {unit_of[p] for p in module.parameters(recurse=module is not root) if p in unit_of}
        if ks:
            reads[module] = sorted(ks, key=order.__getitem__)
    return reads
