"""What a script's `torch.nn.utils.clip_grad_norm_`/`clip_grad_value_` over an engine's parameters asks of it.

The calls reach the engine through the wrappers that runtime/interop/clip_functions.py installs
(while an engine lives, or the launcher's worker runs the script); this module checks what they ask
and keeps it for the window: the engine clips the window's update by the global L2 norm over every
shard, the same as `train.clip_grad_norm`.

What cannot be honoured is refused at the call: another norm type than 2, or a subset of the
model's trainable parameters (the engine clips all of them together).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from zerorun.errors import ZerorunError

log = logging.getLogger("zerorun")



@dataclass
class ClipCall:
    """The script's clipping request for the current window."""

    max_norm: float | None = None  # clip_grad_norm_
    value: float | None = None  # clip_grad_value_
    norm: float | None = None  # the global norm, once measured for this window's gradients


def trainable(engine: Any) -> list[torch.Tensor]:
    """The parameters the engine steps (the ones a clip call over its model must cover)."""
    return [p for unit in engine.store.units for p in unit.params]


def check_call(engine: Any, current: ClipCall | None, params: list[torch.Tensor], function: str,
               norm_type: float = 2.0) -> ClipCall:
    """The window's request, after checking that the engine can do what the call asks."""
    if function == "clip_grad_norm_" and float(norm_type) != 2.0:
        raise ZerorunError(f"torch.nn.utils.clip_grad_norm_(..., norm_type={norm_type}) on the engine's parameters: "
                           "zerorun clips by the global L2 norm only; use norm_type=2 (or train.clip_grad_norm).")
    given = {id(p) for p in params}
    missing = [p for p in trainable(engine) if id(p) not in given]
    if missing:
        raise ZerorunError(
            f"torch.nn.utils.{function} over {len(given)} tensors that leave out {len(missing)} of the model's "
            f"trainable parameters: zerorun clips the engine's update as a whole, over every parameter (the "
            f"gradients are sharded across ranks); pass model.parameters(), or set train.clip_grad_norm.")
    return current if current is not None else ClipCall()


class ScriptClipping:
    """The script's clip calls of the current accumulation window, for one engine."""

    def __init__(self, grad_accum_steps: int) -> None:
        self.call: ClipCall | None = None
        self._accum = grad_accum_steps
        self._told_too_early = False

    def norm(self, engine: Any, params: list[torch.Tensor], max_norm: float, norm_type: float,
             error_if_nonfinite: bool, complete: bool, measure: Callable[[], float]) -> torch.Tensor:
        """`clip_grad_norm_`: keep `max_norm` for the window's update; the global norm (`measure`, once per
        window's gradients), or nan before the window's last backward (`complete`)."""
        self.call = check_call(engine, self.call, params, "clip_grad_norm_", norm_type)
        self.call.max_norm = float(max_norm)
        if not complete:
            return torch.tensor(self._too_early())
        if self.call.norm is None:
            self.call.norm = measure()
        if error_if_nonfinite and not math.isfinite(self.call.norm):
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped.")
        return torch.tensor(self.call.norm)

    def value(self, engine: Any, params: list[torch.Tensor], clip_value: float) -> None:
        """`clip_grad_value_`: the window's averaged gradients are clamped before the update (and its norm)."""
        self.call = check_call(engine, self.call, params, "clip_grad_value_")
        self.call.value = float(clip_value)

    def gradients_changed(self) -> None:
        """A backward began: a norm measured before it is stale."""
        if self.call is not None:
            self.call.norm = None

    def take(self) -> ClipCall:
        """The window's request (empty if the script made none), handed to its update; the next window starts clean."""
        call, self.call = self.call or ClipCall(), None
        return call

    def _too_early(self) -> float:
        """The norm a clip call gets before the window's gradients are all reduced (said once per engine)."""
        if not self._told_too_early:
            self._told_too_early = True
            log.warning("zerorun: clip_grad_norm_ was called before the last backward of an accumulation window "
                        "(train.grad_accum_steps: %d): the gradients are not complete yet, so it returns nan; the "
                        "engine clips the window's update when it ends, and engine.grad_norm holds its norm",
                        self._accum)
        return math.nan
