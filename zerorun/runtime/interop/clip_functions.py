"""`torch.nn.utils.clip_grad_norm_` and `clip_grad_value_`, routed to the engine that owns the parameters.

Under the engine, `param.grad` is empty: backward hooks move every gradient into the reducer's
buffers and reduce it across ranks (grad_reducer.py). torch's clipping functions would find no
gradient, clip nothing and return a norm of 0, so a DDP script's `clip_grad_norm_(model.parameters(),
1.0)` would train unclipped without a word. While held, both functions (in `torch.nn.utils` and
`torch.nn.utils.clip_grad`) are wrappers: a call whose parameters belong to a live engine becomes a
request to that engine (`Engine.clip_grad_norm_`, optim/clip.py), which clips the window's update by the
global L2 norm over every shard, the same as `train.clip_grad_norm`. Parameters of no engine go to
torch's own function, unchanged.

Who holds them: every live engine, from `zerorun.initialize` to `engine.destroy()`; and the launcher's
worker for the whole run of the script, because a script's `from torch.nn.utils import clip_grad_norm_`
binds the function at import, before any engine exists. When the last holder lets go, torch's functions
are back (the very same objects).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad

from zerorun.runtime import context
from zerorun.runtime.interop.patches import AttributePatch, hold_all
from zerorun.runtime.optim.clip import trainable


def _route_norm(engine: Any, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    norm: torch.Tensor = engine.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    return norm


def _route_value(engine: Any, params: list[torch.Tensor], clip_value: float, foreach: bool | None = None) -> None:
    engine.clip_grad_value_(params, clip_value)


_ROUTES: dict[str, Callable[..., Any]] = {"clip_grad_norm_": _route_norm, "clip_grad_value_": _route_value}


def _wrapper(routed: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(parameters: Any, *args: Any, **kwargs: Any) -> Any:
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            engine = engine_of(params)
            if engine is None:
                return original(params, *args, **kwargs)
            return routed(engine, params, *args, **kwargs)

        wrapper._zerorun_routed = True  # type: ignore[attr-defined]
        return wrapper
    return wrap


_PATCHES = [AttributePatch(module, name, _wrapper(routed))
            for module in (torch.nn.utils, torch.nn.utils.clip_grad) for name, routed in _ROUTES.items()]


def hold() -> Callable[[], None]:
    """Route both functions (in both modules) until the returned release is called."""
    return hold_all(_PATCHES)


def engine_of(params: list[torch.Tensor]) -> Any:
    """The live engine stepping any of `params`, or None."""
    ids = {id(p) for p in params}
    for engine in context.current().engines.live():
        if any(id(p) in ids for p in trainable(engine)):
            return engine
    return None
