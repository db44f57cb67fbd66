"""The torch Optimizer face of an engine's optimizers: their param groups, one object a scheduler can drive.

`engine.optimizer` is a `torch.optim.Optimizer` whose `param_groups` are the very dicts of the
optimizers the script handed over (all of them, in order, for a list), so `param_groups` behaves as
users expect and a stock `torch.optim.lr_scheduler` built on it (the recipe's `scheduler`, DeepSpeed's
`lr_scheduler`) sets what the update uses. It holds no state: the update and its state are
`update.py`'s, performed by the script's optimizer objects or zerorun's fused Adam kernel.
"""

from __future__ import annotations

from typing import Any

import torch

from zerorun.errors import ZerorunError


class ShardedOptimizer(torch.optim.Optimizer):
    """The param groups of every handed-over optimizer, as one torch Optimizer (see the module docstring)."""

    def __init__(self, param_groups: list[dict[str, Any]], handed_over: list[torch.optim.Optimizer]) -> None:
        """`param_groups`: the script's own group dicts, in the engine's order; `handed_over`: their optimizers."""
        defaults = dict(handed_over[0].defaults) if handed_over else {"lr": 1e-3}
        super().__init__([{"params": []}], defaults)
        self._groups_fixed = True  # the flat layout is built from these groups, once
        # one optimizer: its very list (code holding `optimizer.param_groups` sees the engine's); several: theirs joined
        self.param_groups = handed_over[0].param_groups if len(handed_over) == 1 else param_groups
        self.handed_over = handed_over

    def count_step(self) -> None:
        """Tell torch's LR schedulers, on this optimizer or a handed-over one, that a step happened.

        A scheduler wraps `optimizer.step` to set `optimizer._opt_called` and warns ("lr_scheduler.step()
        before optimizer.step()") when that flag is unset at its first step (torch/optim/lr_scheduler.py,
        the same contract from torch 2.2 through 2.13). The engine's update is the optimizer's step (a fused
        Adam group never calls the script's), so it sets the flag itself.
        """
        self._opt_called = True
        for optimizer in self.handed_over:
            optimizer._opt_called = True  # type: ignore[attr-defined]

    def step(self, closure: Any = None) -> None:  # type: ignore[override]  # noqa: D102 - refuses: the engine drives the update
        raise ZerorunError(REFUSALS["step"])

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102
        raise ZerorunError(REFUSALS["zero_grad"])

    def state_dict(self) -> dict[str, Any]:  # noqa: D102
        raise ZerorunError(REFUSALS["state_dict"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # noqa: D102
        raise ZerorunError(REFUSALS["state_dict"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:  # noqa: D102
        if getattr(self, "_groups_fixed", False):
            raise ZerorunError("zerorun lays parameters out once, at zerorun.initialize: add every param group to "
                               "the optimizer before handing it over.")
        # torch's add_param_group is wrapped in torch._disable_dynamo, whose first call imports torch._dynamo
        # (and sympy, inductor, FSDP): tens of MiB of RSS per rank that nothing else in the runtime needs
        add = torch.optim.Optimizer.add_param_group
        getattr(add, "__wrapped__", add)(self, param_group)


_STATE_DICT = ("this optimizer's state is sharded across ranks by the zerorun engine: save and restore it with "
               "engine.save_checkpoint(dir) and engine.load_checkpoint(dir) (moments, step counts and param "
               "groups included).")
# what the engine's optimizer, and the one the script handed over (runtime/interop/optimizer_guard.py), say
REFUSALS = {
    "step": "this optimizer is driven by the zerorun engine: call engine.step(), which reduces gradients across "
            "ranks and updates the shard this rank owns (at accumulation boundaries). Its param groups stay live: "
            "an LR scheduler on it, or group['lr'] = ..., still sets what engine.step() uses.",
    "zero_grad": "this optimizer is driven by the zerorun engine: engine.step() already clears gradients after every "
                 "update; call engine.zero_grad() to drop gradients accumulated since the last update.",
    "state_dict": _STATE_DICT,
    "load_state_dict": _STATE_DICT,
}
