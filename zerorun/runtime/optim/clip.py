"""`torch.nn.utils.clip_grad_norm_` and `clip_grad_value_` on an engine's parameters, done by the engine.

Under the engine, `param.grad` is empty: backward hooks move every gradient into the reducer's
buffers and reduce it across ranks (grad_reducer.py). torch's clipping functions would find no
gradient, clip nothing and return a norm of 0, so a DDP script's `clip_grad_norm_(model.parameters(),
1.0)` would train unclipped without a word. zerorun wraps both functions (in `torch.nn.utils` and
`torch.nn.utils.clip_grad`; the worker does it before the script is imported, so a
`from torch.nn.utils import clip_grad_norm_` binds the wrapper too): a call whose parameters belong to
an engine becomes a request to that engine, which clips the window's update by the global L2 norm
over every shard, the same as `train.clip_grad_norm`. Parameters of no engine go to torch as before.

What cannot be honoured is refused at the call: another norm type than 2, or a subset of the
model's trainable parameters (the engine clips all of them together).
"""

from __future__ import annotations

import functools
import logging
import math
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from zerorun.errors import ZerorunError

log = logging.getLogger("zerorun")

_engines: weakref.WeakSet[Any] = weakref.WeakSet()
_told_too_early = False


@dataclass
class ClipCall:
    """The script's clipping request for the current window."""

    max_norm: float | None = None  # clip_grad_norm_
    value: float | None = None  # clip_grad_value_
    norm: float | None = None  # the global norm, once measured for this window's gradients


def route_to(engine: Any) -> None:
    """Send clipping calls over `engine`'s parameters to it (installs the wrappers once per process)."""
    _engines.add(engine)
    install()


def install() -> None:
    """Wrap torch's two clipping functions where scripts find them (idempotent)."""
    for module in (torch.nn.utils, torch.nn.utils.clip_grad):
        for name, routed in (("clip_grad_norm_", _routed_norm), ("clip_grad_value_", _routed_value)):
            current = getattr(module, name)
            if not getattr(current, "_zerorun_routed", False):
                setattr(module, name, _wrap(current, routed))


def _wrap(original: Callable[..., Any], routed: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        engine = _engine_of(params)
        if engine is None:
            return original(params, *args, **kwargs)
        return routed(engine, params, *args, **kwargs)

    wrapper._zerorun_routed = True  # type: ignore[attr-defined]
    return wrapper


def _routed_norm(engine: Any, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                 error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    norm: torch.Tensor = engine.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    return norm


def _routed_value(engine: Any, params: list[torch.Tensor], clip_value: float, foreach: bool | None = None) -> None:
    engine.clip_grad_value_(params, clip_value)


def _engine_of(params: list[torch.Tensor]) -> Any:
    ids = {id(p) for p in params}
    for engine in list(_engines):
        if any(id(p) in ids for p in _trainable(engine)):
            return engine
    return None


def _trainable(engine: Any) -> list[torch.Tensor]:
    return [p for unit in engine.store.units for p in unit.params]


def check_call(engine: Any, current: ClipCall | None, params: list[torch.Tensor], function: str,
               norm_type: float = 2.0) -> ClipCall:
    """The window's request, after checking that the engine can do what the call asks."""
    if function == "clip_grad_norm_" and float(norm_type) != 2.0:
        raise ZerorunError(f"torch.nn.utils.clip_grad_norm_(..., norm_type={norm_type}) on the engine's parameters: "
                           "zerorun clips by the global L2 norm only; use norm_type=2 (or train.clip_grad_norm).")
    given = {id(p) for p in params}
    missing = [p for p in _trainable(engine) if id(p) not in given]
    if missing:
        raise ZerorunError(
            f"torch.nn.utils.{function} over {len(given)} tensors that leave out {len(missing)} of the model's "
            f"trainable parameters: zerorun clips the engine's update as a whole, over every parameter (the "
            f"gradients are sharded across ranks); pass model.parameters(), or set train.clip_grad_norm.")
    return current if current is not None else ClipCall()


def too_early(accum: int) -> float:
    """The norm a clip call gets before the window's gradients are all reduced (said once per process)."""
    global _told_too_early
    if not _told_too_early:
        _told_too_early = True
        log.warning("zerorun: clip_grad_norm_ was called before the last backward of an accumulation window "
                    "(train.grad_accum_steps: %d): the gradients are not complete yet, so it returns nan; the "
                    "engine clips the window's update when it ends, and engine.grad_norm holds its norm", accum)
    return math.nan
