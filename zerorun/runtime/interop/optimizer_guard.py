"""The optimizer the script handed to `zerorun.initialize` refuses what would do nothing or the wrong thing.

The engine steps the handed-over optimizer itself (optim/update.py), over what this rank owns, and
shares its `param_groups` (a scheduler on it drives the update); its state is sharded across ranks.
The script's own `optimizer.step()`, `zero_grad()`, `state_dict()` and `load_state_dict()` would step
parameters whose gradients the engine took, clear nothing, or save one rank's share as if it were the
whole. They refuse, with a message that says what to call instead, until the engine is destroyed;
the engine's own steps pass (`engine_steps`).

`step` refuses through a step pre-hook, which runs inside torch's own `step` wrapper: a scheduler
built on the optimizer before or after this keeps its wrapper (replacing `step` would make it warn
that step was overridden). The other three are shadowed on the instance; the undo deletes them again.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerorun.errors import ZerorunError
from zerorun.runtime.optim.optimizer import REFUSALS


def refuse_direct_use(optimizer: torch.optim.Optimizer, engine_steps: Callable[[], bool]) -> Callable[[], None]:
    """Make `optimizer` refuse direct use, but for the steps the engine makes (`engine_steps()` true); returns the
    undo."""
    def refuse(message: str) -> Any:
        def method(*args: Any, **kwargs: Any) -> Any:
            raise ZerorunError(message)
        return method

    def refuse_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not engine_steps():
            raise ZerorunError(REFUSALS["step"])

    hook = optimizer.register_step_pre_hook(refuse_step)
    shadowed = {name: refuse(REFUSALS[name]) for name in ("zero_grad", "state_dict", "load_state_dict")
                if name not in vars(optimizer)}  # one the script set on the instance itself stays the script's
    vars(optimizer).update(shadowed)

    def remove() -> None:
        hook.remove()
        for name, method in shadowed.items():
            if vars(optimizer).get(name) is method:
                del vars(optimizer)[name]
    return remove
