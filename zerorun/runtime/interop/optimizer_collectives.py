"""A handed-over optimizer that communicates by itself is refused when it does, before its collective runs.

The engine steps a script's optimizer on every rank over what that rank updates: the parameters it owns whole, or
a flat piece of them (optim/update.py). An optimizer whose `step()` spreads its own work over the ranks (Keller
Jordan's distributed `Muon` and `MuonWithAuxAdam`, which step every world-size-th matrix and all-gather the rest)
then exchanges lists that differ from rank to rank: gloo fails deep inside ("invalid tensor size"), and where the
shapes happen to agree, other ranks' values land in this rank's parameters and training goes on, wrong. zerorun
already spreads the step, so while the engine steps a script's optimizer, every `torch.distributed` collective is
refused in words that name the optimizer, the call, and what to hand over instead.

Held with the guards of a handed-over optimizer (`Interop.guard_optimizers`), released with its engine.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.runtime import context
from zerorun.runtime.interop.patches import AttributePatch, hold_all

COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "all_to_all",
               "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object_list", "gather",
               "gather_object", "irecv", "isend", "recv", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "scatter", "scatter_object_list", "send")


def _refusing(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(collective: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(collective)
        def refuse_inside_a_step(*args: Any, **kwargs: Any) -> Any:
            runtime = context.existing()  # a thread without one (a worker's) steps no optimizer
            if runtime is not None and runtime.engines.stepping_an_optimizer():
                raise ZerorunError(refusal(name, _stepped_optimizer()))
            return collective(*args, **kwargs)
        return refuse_inside_a_step
    return wrap


def refusal(call: str, optimizer: str) -> str:
    return (f"{optimizer}.step() called torch.distributed.{call} while zerorun stepped it. zerorun runs the optimizer "
            f"handed to zerorun.initialize on every rank over what that rank updates (the parameters it owns, or a "
            f"piece of them), so an optimizer that spreads its own work over the ranks exchanges lists that differ "
            f"from rank to rank: a crash, or other ranks' values written into this rank's parameters. zerorun already "
            f"spreads the step: hand over the optimizer's single-process form instead (Keller Jordan's Muon: "
            f"SingleDeviceMuon or SingleDeviceMuonWithAuxAdam; or torch.optim.Muon, or `optimizer.type: muon` in the "
            f"recipe).")


def _stepped_optimizer() -> str:
    """The class of the optimizer whose `step` is on the stack (the caller of the refused collective)."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, torch.optim.Optimizer):
            return type(owner).__name__
        frame = frame.f_back  # type: ignore[assignment]
    return "the handed-over optimizer"


_PATCHES = tuple(AttributePatch(dist, name, _refusing(name)) for name in COLLECTIVES if hasattr(dist, name))


def hold() -> Callable[[], None]:
    """Refuse collectives inside the engine's steps of a script's optimizer until the returned release is called."""
    return hold_all(_PATCHES)
