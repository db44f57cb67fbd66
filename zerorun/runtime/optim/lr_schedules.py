"""The learning-rate schedulers around an engine: who steps them, and their state in checkpoints.

A torch LR scheduler keeps state the optimizer does not (its step count, base and last lrs). A
resume that rebuilt it from scratch would start the warm-up again, silently: so every checkpoint
carries the state of every scheduler that drives the engine's optimizer, and a resume restores it.

| owner    | which schedulers                                                    | stepped by                       |
|----------|---------------------------------------------------------------------|----------------------------------|
| `ENGINE` | `zerorun.initialize(lr_scheduler=...)`, or the recipe's `scheduler` | the engine, after every applied update (DeepSpeed's contract) |
| `SCRIPT` | any `torch.optim.lr_scheduler` the script built on the engine's optimizer or on the one it handed over | the script |

The script's schedulers are found by the function the engine hands in (`find`: runtime/interop/
schedulers.py, which asks the garbage collector what refers to the optimizer and says why); it runs at the
first update, at saves and while a restore waits, never every step. A `SequentialLR` or `ChainedScheduler` is one scheduler:
its children are part of its state.

A save taken inside `engine.step()` (`checkpoint.every_steps`) lands before the script's own
`scheduler.step()` of that iteration, and the resumed script starts at the next iteration, so it
never makes that call. Such a save therefore records how many times the script stepped each
scheduler between the previous update and the engine call after it (once, for a loop that calls
`scheduler.step()` right after `engine.step()`), and the restore replays that many steps. A
scheduler the script builds after `zerorun.initialize` (after the resume) is restored when the
engine is next entered (a forward, backward or step), before any update uses its lr.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch

from zerorun.errors import ZerorunError

log = logging.getLogger("zerorun")


class Owner(Enum):
    ENGINE = "engine"
    SCRIPT = "script"


@dataclass(eq=False)
class _Tracked:
    scheduler: Any  # an LRScheduler (or anything with step/state_dict/load_state_dict and last_epoch)
    owner: Owner
    epoch_at_update: int | None = None  # last_epoch when the last update ended (None: entered since)
    steps_after_update: int | None = None  # the script's steps between an update and the next engine call

    @property
    def name(self) -> str:
        return type(self.scheduler).__name__


class LrSchedules:
    """The schedulers that drive `optimizer` (the engine's) and `handed_over` (the script's, if any)."""

    def __init__(self, optimizer: torch.optim.Optimizer, handed_over: list[torch.optim.Optimizer],
                 find: Callable[[list[torch.optim.Optimizer]], list[Any]], owned: Any = None,
                 recipe_says: str | None = None) -> None:
        """`handed_over`: the script's optimizers (none for the recipe's); `find`: the schedulers built on some of the
        optimizers; `owned`: a scheduler the engine steps; `recipe_says`: where the recipe set it (for messages)."""
        self._find = find
        self._optimizers = [optimizer, *handed_over]
        self._recipe_says = recipe_says
        self._tracked: list[_Tracked] = []
        if owned is not None:
            if getattr(owned, "optimizer", None) not in self._optimizers:
                raise ZerorunError(f"zerorun.initialize(lr_scheduler=...): the {type(owned).__name__} is built on "
                                   "another optimizer than the one handed to zerorun.initialize; build it on that "
                                   "optimizer (or on engine.optimizer).")
            self._tracked.append(_Tracked(owned, Owner.ENGINE, owned.last_epoch))
        self._pending: list[dict[str, Any]] = []  # restored entries still waiting for their scheduler
        self._searched = False
        self._saving_inside_step = False
        self._first_lrs: list[float] | None = None
        self._warned_unreached = False

    @property
    def owned(self) -> Any:
        """The scheduler the engine steps (None: the script steps its own, if any)."""
        return next((t.scheduler for t in self._tracked if t.owner is Owner.ENGINE), None)

    # -- the training loop --------------------------------------------------------------------
    def engine_entered(self) -> None:
        """A forward, backward or step begins: learn what the script did since the last update."""
        for t in self._tracked:
            if t.epoch_at_update is None:
                continue
            stepped = t.scheduler.last_epoch - t.epoch_at_update
            if t.owner is Owner.ENGINE and stepped:
                raise ZerorunError(
                    f"the {t.name} {self._owned_how()} is stepped by the engine after every update; the script "
                    f"stepped it too ({stepped}x since the last update), which would advance it twice. Remove the "
                    "script's scheduler.step() call.")
            t.steps_after_update = stepped
            t.epoch_at_update = None
        if self._pending:
            self._search()
            self._apply_pending()

    def update_applied(self) -> None:
        """An update was applied: step the engine's schedulers."""
        for t in self._tracked:
            if t.owner is Owner.ENGINE:
                t.scheduler.step()

    def update_ended(self) -> None:
        """After every update (applied or skipped): mark where each scheduler stands."""
        if not self._searched:
            self._search()
            self._first_lrs = [float(g["lr"]) for g in self._optimizers[0].param_groups]
        if self._pending:
            names = ", ".join(e["class"] for e in self._pending)
            log.warning("zerorun: the checkpoint holds the state of %s, but no such scheduler drives the engine's "
                        "optimizer by the first update after the resume: it was not restored", names)
            self._pending = []
        for t in self._tracked:
            t.epoch_at_update = t.scheduler.last_epoch

    def _owned_how(self) -> str:
        return f"of the recipe's scheduler section ({self._recipe_says})" if self._recipe_says else \
            "passed to zerorun.initialize(lr_scheduler=...)"

    def _search(self) -> None:
        """Track every script scheduler on the optimizers that is not tracked yet."""
        self._searched = True
        known = {id(t.scheduler) for t in self._tracked}
        for found in self._find(self._optimizers):
            if id(found) in known:
                continue
            engine_owned = [t for t in self._tracked if t.owner is Owner.ENGINE]
            if engine_owned and self._recipe_says:
                raise ZerorunError(
                    f"two learning-rate schedulers drive the engine's optimizer: the recipe's "
                    f"{engine_owned[0].name} ({self._recipe_says}), which the engine steps, and a {type(found).__name__} "
                    "the script built. Remove the recipe's scheduler section, or the script's scheduler.")
            self._tracked.append(_Tracked(found, Owner.SCRIPT))

    # -- checkpoints --------------------------------------------------------------------------
    @contextmanager
    def saving_inside_step(self) -> Iterator[None]:
        """A save made by `engine.step()` itself (see the module docstring)."""
        self._saving_inside_step = True
        try:
            yield
        finally:
            self._saving_inside_step = False

    def checkpoint_entries(self, global_step: int) -> list[dict[str, Any]]:
        """What a checkpoint records of every scheduler (JSON), found afresh."""
        self._search()
        self._warn_if_unreached()
        entries = []
        for t in self._tracked:
            replay = 0
            if self._saving_inside_step and t.owner is Owner.SCRIPT:
                replay = self._steps_due(t, global_step)
            entries.append({"class": t.name, "owner": t.owner.value, "state": _jsonable_state(t.scheduler),
                            "lrs": [float(g["lr"]) for g in t.scheduler.optimizer.param_groups], "replay": replay})
        return entries

    @staticmethod
    def _steps_due(t: _Tracked, global_step: int) -> int:
        """The script's steps of `t` still to come in this iteration (what the last iteration did; before any
        history, once if the scheduler has been stepped once per update so far, as torch's loops do)."""
        if t.steps_after_update is not None:
            return t.steps_after_update
        return 1 if t.scheduler.last_epoch == global_step - 1 else 0

    def _warn_if_unreached(self) -> None:
        """A changing lr with no scheduler to save: a schedule kept outside the optimizer."""
        if self._tracked or self._warned_unreached or self._first_lrs is None:
            return
        now = [float(g["lr"]) for g in self._optimizers[0].param_groups]
        changed = [(i, a, b) for i, (a, b) in enumerate(zip(self._first_lrs, now)) if not math.isclose(a, b)]
        if changed:
            i, a, b = changed[0]
            self._warned_unreached = True
            log.warning("zerorun: the lr of param group %d changed since the first update (%g -> %g), but no "
                        "torch.optim.lr_scheduler drives the engine's optimizer, so the checkpoint holds no "
                        "schedule: if an object of the script sets the lr, keep its state in engine.client_state "
                        "(saved and restored with every checkpoint)", i, a, b)

    def restore(self, entries: list[dict[str, Any]]) -> None:
        """Restore the schedulers of a checkpoint: now where they exist, else when they appear."""
        self._pending = list(entries)
        self._search()
        self._apply_pending()

    def _apply_pending(self) -> None:
        waiting = []
        free = list(self._tracked)
        for entry in self._pending:
            match = next((t for t in free if t.owner.value == entry["owner"] and t.name == entry["class"]), None)
            if match is None:
                waiting.append(entry)
                continue
            free.remove(match)
            _load(match.scheduler, entry)
            match.epoch_at_update = None
        self._pending = waiting


def _load(scheduler: Any, entry: dict[str, Any]) -> None:
    """Set the lrs the checkpoint saw, load the state, replay the script's steps that the save preceded."""
    for group, lr in zip(scheduler.optimizer.param_groups, entry["lrs"]):
        group["lr"] = lr
    scheduler.load_state_dict({**scheduler.state_dict(), **entry["state"]})
    for _ in range(entry["replay"]):
        scheduler.step()


def _jsonable_state(scheduler: Any) -> dict[str, Any]:
    """The scheduler's state dict as JSON values (callables left out: the script's code rebuilds them)."""
    def convert(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.tolist()
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items() if not callable(v)}
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        if hasattr(value, "item") and not isinstance(value, (str, bytes)):
            return value.item()  # a numpy scalar
        return value

    return {k: convert(v) for k, v in scheduler.state_dict().items() if not callable(v)}
