"""The optimizer the script handed to `zerorun.initialize` refuses what would do nothing or the wrong thing.

The engine steps the handed-over optimizer itself (optim/update.py), over what this rank owns, and
shares its `param_groups` (a scheduler on it drives the update); its state is sharded across ranks.
The script's own `optimizer.step()` and `zero_grad()` would step parameters whose gradients the engine took
or clear nothing: they refuse, with a message that says what to call instead, until the engine is destroyed;
the engine's own steps pass (`engine_steps`). `state_dict()` and `load_state_dict()` would save or restore one
rank's share as if it were the whole: they answer with the whole state instead, gathered and scattered by the
engine (checkpoint/full_optimizer.py), on this optimizer and on `engine.optimizer` alike.

`step` refuses through a step pre-hook, which runs inside torch's own `step` wrapper: a scheduler
built on the optimizer before or after this keeps its wrapper (replacing `step` would make it warn
that step was overridden). The other three are shadowed on the instance; the undo deletes them again.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from zerorun.errors import ZerorunError
from zerorun.runtime.optim.optimizer import REFUSALS


class WholeState:
    """`optimizer`'s state_dict()/load_state_dict() through its engine, which it does not keep alive."""

    def __init__(self, engine: Any, optimizer: torch.optim.Optimizer) -> None:
        self._engine, self._optimizer = weakref.ref(engine), weakref.ref(optimizer)

    def _both(self) -> tuple[Any, torch.optim.Optimizer]:
        engine, optimizer = self._engine(), self._optimizer()
        if engine is None or optimizer is None:
            raise ZerorunError(REFUSALS["state_dict"])
        return engine, optimizer

    def state_dict(self) -> dict[str, Any]:
        engine, optimizer = self._both()
        return engine.checkpoints.optimizer_state_dict(optimizer)  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine, optimizer = self._both()
        engine.checkpoints.load_optimizer_state_dict(optimizer, state_dict)


def refuse_direct_use(optimizer: torch.optim.Optimizer, engine_steps: Callable[[], bool],
                      whole: WholeState | None = None) -> Callable[[], None]:
    """Make `optimizer` refuse direct use, but for the steps the engine makes (`engine_steps()` true), and answer
    state_dict()/load_state_dict() through `whole` (refused without it); returns the undo."""
    def refuse(message: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Any:
            raise ZerorunError(message)
        return method

    def refuse_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not engine_steps():
            raise ZerorunError(REFUSALS["step"])

    hook = optimizer.register_step_pre_hook(refuse_step)
    answers: dict[str, Any] = {name: refuse(REFUSALS[name]) for name in ("zero_grad", "state_dict", "load_state_dict")}
    if whole is not None:
        answers.update(state_dict=whole.state_dict, load_state_dict=whole.load_state_dict)
    shadowed = {name: method for name, method in answers.items()
                if name not in vars(optimizer)}  # one the script set on the instance itself stays the script's
    vars(optimizer).update(shadowed)

    def remove() -> None:
        hook.remove()
        for name, method in shadowed.items():
            if vars(optimizer).get(name) is method:
                del vars(optimizer)[name]
    return remove
