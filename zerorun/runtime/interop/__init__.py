"""Everything zerorun changes outside itself, in one place: installed with an engine, removed with it.

| what                                                         | installed                       | removed                              | module |
|--------------------------------------------------------------|---------------------------------|--------------------------------------|--------|
| `torch.nn.utils[.clip_grad].clip_grad_norm_`/`clip_grad_value_` wrapped: calls over an engine's parameters go to it | `zerorun.initialize`; the worker, before the script is imported | the last `engine.destroy()`; the worker, when the script returns | clip_functions.py |
| `torch.distributed.destroy_process_group` wrapped: settles the engines and meets the other ranks first | the worker, before the script is imported | the worker, when the script returns | process_group.py |
| `torch.distributed.init_process_group` wrapped: the script's own call joins the job the worker joined | the worker, before the script is imported | the worker, when the script returns | process_group.py |
| the model root's class: a same-named subclass whose `named_parameters()` waits for a deferred publish | `zerorun.initialize` (stages 1/2 with `zero.overlap_publish`) | `engine.destroy()` | publish_guard.py |
| the handed-over optimizer: a step pre-hook and `zero_grad`/`state_dict`/`load_state_dict` that refuse | `zerorun.initialize(model, optimizer)` | `engine.destroy()` | optimizer_guard.py |
| `torch.distributed`'s collectives wrapped: refused while the engine steps a handed-over optimizer (one that communicates by itself) | `zerorun.initialize(model, optimizer)` | `engine.destroy()` | optimizer_collectives.py |
| stage 3: the model root's `state_dict()` hooks: its trainable entries gathered (every rank calls it) | `zerorun.initialize` (stage 3) | `engine.destroy()` | state_dict_gather.py |
| nothing (reads only): the script's LR schedulers found through `gc.get_referrers` | - | - | schedulers.py |

An engine the script drops without `destroy()` has the same done when it is garbage-collected. A second
engine over parameters of a live one takes them over: the first engine's interceptions are removed (with
a warning) before the second's are installed, so a clip call or a publish wait has one owner.
Not listed, because the script asks for them by name: `with zerorun.sharded_init():` (replaces
`nn.Module.register_parameter` inside the block only) and the module hooks the stages register on the
model (the reducer's gradient hooks, stage 3's gathers), which are how the engine does its work.
docs/coming-from-ddp.md lists the same, with how to opt out of each.

May import optim (what a routed clip call checks, what a refusal says); never the engine, a store or
checkpoints: the engine hands it what it guards.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable

import torch
from torch import nn

from zerorun.runtime import context
from zerorun.runtime.interop import clip_functions, optimizer_collectives, process_group
from zerorun.runtime.interop.optimizer_guard import WholeState, refuse_direct_use
from zerorun.runtime.interop.publish_guard import guard_parameter_reads
from zerorun.runtime.interop.schedulers import schedulers_of
from zerorun.runtime.interop.state_dict_gather import gather_state_dicts
from zerorun.runtime.optim.clip import trainable

__all__ = ["Interop", "hold_for_script", "live", "schedulers_of", "settle_all"]

log = logging.getLogger("zerorun")


def live() -> list[Any]:
    """The live engines of this thread's runtime (runtime/context.py), oldest first."""
    return context.current().engines.live()


def settle_all() -> None:
    """Finish the collectives the live engines of this thread's runtime still have in flight."""
    context.current().engines.settle_all()


class Interop:
    """What one engine changes outside zerorun, and the undo of each; `remove()` undoes them all, once."""

    def __init__(self, engine: Any) -> None:
        self._undo: list[Callable[[], None]] = []
        self.models: list[nn.Module] = []  # the models this engine wraps (compared by identity)
        # the engine garbage-collected without destroy(): the same undo (this object holds no reference to it)
        self._finalizer = weakref.finalize(engine, self._undo_all)

    @property
    def installed(self) -> bool:
        return self._finalizer.alive

    def take_over(self, engine: Any, model: nn.Module) -> None:
        """Remove the interceptions of any live engine that steps the same parameters or wraps the same model."""
        mine = {id(p) for p in trainable(engine)}
        for other in engine.runtime.engines.live():
            if other is engine:
                continue
            shared = any(model is m for m in other.interop.models) or any(id(p) in mine for p in trainable(other))
            if shared and other.interop.installed:
                log.warning("zerorun: a new engine wraps the model of a live one; the earlier engine's clip routing "
                            "and guards are removed (call engine.destroy() before building another engine over "
                            "the same model)")
                other.interop.remove()
        self.models.append(model)

    def route_clip_calls(self, engine: Any) -> None:
        """torch's clip functions, called over this engine's parameters, reach this engine."""
        live_engines = engine.runtime.engines
        live_engines.enter(engine)
        ref = weakref.ref(engine)
        self._undo.append(clip_functions.hold())
        self._undo.append(lambda: live_engines.leave(ref()))

    def remove_with_engine(self, remove_hooks: Callable[[], None]) -> None:
        """Hooks the runtime put on the script's modules and parameters (the reducer's, stage 3's scheduler's and
        groups', the deferred publish's waits): removed with the rest, at destroy, collection or a takeover."""
        self._undo.append(remove_hooks)

    def guard_parameter_reads(self, root: nn.Module, wait_all: Callable[[], None]) -> None:
        """`root.parameters()`/`named_parameters()` wait for the deferred publish (publish_guard.py)."""
        self._undo.append(guard_parameter_reads(root, wait_all))

    def gather_state_dicts(self, root: nn.Module, full_values: Callable[[nn.Module], dict[str, torch.Tensor]]) -> None:
        """Stage 3: `root.state_dict()` holds whole parameters, gathered on every rank (state_dict_gather.py)."""
        self._undo.append(gather_state_dicts(root, full_values))

    def guard_optimizers(self, engine: Any, handed_over: list[torch.optim.Optimizer]) -> None:
        """The handed-over optimizers refuse to step, but for the engine's own steps; they and `engine.optimizer`
        answer state_dict()/load_state_dict() with the whole state (optimizer_guard.py)."""
        for optimizer in (*handed_over, engine.optimizer):
            self._undo.append(refuse_direct_use(optimizer, engine.update.is_stepping, WholeState(engine, optimizer)))
        if handed_over:  # a script's optimizer may communicate by itself: refused inside the engine's steps
            self._undo.append(optimizer_collectives.hold())

    def remove(self) -> None:
        """Undo every interception of this engine (idempotent)."""
        self._finalizer()

    def _undo_all(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.models.clear()


def hold_for_script() -> Callable[[], None]:
    """What the launcher's worker holds while the script runs: the clip functions (a script binds them at import,
    before its engine exists), the joining `init_process_group` and the settling `destroy_process_group`. Returns
    the release."""
    releases = [clip_functions.hold(), process_group.hold()]

    def release() -> None:
        for each in releases:
            each()
    return release
