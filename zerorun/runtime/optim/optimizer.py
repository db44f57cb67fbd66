"""Adam(W) over flat fp32 shards, with the user's param groups and hyper-parameters.

`ShardedAdamW` is a `torch.optim.Optimizer`, so `param_groups` behaves as users expect and a
stock `torch.optim.lr_scheduler` can drive it. It holds the hyper-parameters and step counts; the
state itself (fp32 master, `exp_avg`, `exp_avg_sq`: per param group, this rank's pieces only) lives
in the home the placement chose (homes.py), and `AdamStep` (adam_step.py) runs the update.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from zerorun.config import OptimizerConfig
from zerorun.errors import ZerorunError

HYPER = ("lr", "betas", "eps", "weight_decay")


def param_groups_from(optimizer: torch.optim.Optimizer | None, model: nn.Module,
                      cfg: OptimizerConfig) -> tuple[list[dict[str, Any]], bool]:
    """The param groups to take over (trainable parameters only) and whether decay is decoupled."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        group: dict[str, Any] = {"params": params, "lr": cfg.lr, "betas": tuple(cfg.betas), "eps": cfg.eps,
                 "weight_decay": cfg.weight_decay}
        return [group], cfg.type == "adamw"
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ZerorunError(f"zerorun.initialize takes over torch.optim.Adam or AdamW, got {type(optimizer).__name__}; "
                           "pass optimizer=None to use the recipe's optimizer section.")
    if any(state for state in optimizer.state.values()):
        # taking the groups over without it would restart Adam's moments and bias correction silently
        raise ZerorunError(f"the {type(optimizer).__name__} passed to zerorun.initialize already holds state "
                           f"({len(optimizer.state)} parameters: steps and moments, from a step() or a "
                           "load_state_dict()); zerorun's engine starts Adam's state fresh and would drop it. "
                           "Pass a fresh optimizer, and resume through checkpoint.dir / engine.load_checkpoint.")
    decoupled = isinstance(optimizer, torch.optim.AdamW)
    groups: list[dict[str, Any]] = []
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag):
                raise ZerorunError(f"optimizer param group {i}: {flag}=True is not supported by zerorun's Adam.")
        decoupled = decoupled or bool(group.get("decoupled_weight_decay", False))
        params = [p for p in group["params"] if p.requires_grad]
        groups.append({"params": params, **{k: group[k] for k in HYPER}})
    owned = {p for g in groups for p in g["params"]}
    stray = [n for n, p in model.named_parameters() if p.requires_grad and p not in owned]
    if stray:
        raise ZerorunError(f"trainable parameters missing from the optimizer's param groups: {', '.join(stray[:5])}"
                           f"{' ...' if len(stray) > 5 else ''}; add them to a group or set requires_grad=False.")
    return groups, decoupled


class ShardedAdamW(torch.optim.Optimizer):
    """Adam(W) whose state covers this rank's flat pieces only.

    Given the user's optimizer (`handed_over`), it shares that optimizer's `param_groups` list, the
    very same dicts: a scheduler built on either object, before or after `zerorun.initialize`, and
    code that sets `group["lr"]`, drive the engine's update. The user's optimizer itself can no
    longer step or hold state (the engine's interop makes it refuse: runtime/interop/optimizer_guard.py).
    """

    def __init__(self, groups: list[dict[str, Any]], decoupled: bool,
                 handed_over: torch.optim.Optimizer | None = None) -> None:
        defaults = {k: groups[0][k] for k in HYPER} if groups else {"lr": 1e-3}
        super().__init__(groups, defaults)
        self._groups_fixed = True  # the flat layout is built from these groups, once
        if handed_over is not None:
            assert len(handed_over.param_groups) == len(groups), "one engine group per param group of the optimizer"
            self.param_groups = handed_over.param_groups
            self.defaults = handed_over.defaults
        self.handed_over = handed_over
        self.decoupled = decoupled
        self.steps = [0 for _ in groups]  # a Python int: no device sync to read it

    def group_step(self, group: int, grad_divisor: float) -> dict[str, Any]:
        """Count one update of `group` and return the kernel's arguments for it (`ops.adamw_step`)."""
        hyper = self.preview(group, grad_divisor)
        self.steps[group] += 1
        return hyper

    def preview(self, group: int, grad_divisor: float) -> dict[str, Any]:
        """The kernel's arguments for `group`'s next update, as they stand now, without counting it."""
        hyper = self.param_groups[group]
        beta1, beta2 = hyper["betas"]
        return dict(step=self.steps[group] + 1, lr=float(hyper["lr"]), beta1=float(beta1), beta2=float(beta2),
                    eps=float(hyper["eps"]), weight_decay=float(hyper["weight_decay"]), decoupled=self.decoupled,
                    grad_divisor=grad_divisor)

    def count_step(self) -> None:
        """Tell torch's LR schedulers, on this optimizer or the handed-over one, that a step happened.

        A scheduler wraps `optimizer.step` to set `optimizer._opt_called` and warns ("lr_scheduler.step()
        before optimizer.step()") when that flag is unset at its first step (torch/optim/lr_scheduler.py,
        the same contract from torch 2.2 through 2.13). The engine's update is the optimizer's step, so
        it sets the flag itself rather than calling a `step` that must not run.
        """
        self._opt_called = True
        if self.handed_over is not None:
            self.handed_over._opt_called = True  # type: ignore[attr-defined]

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
