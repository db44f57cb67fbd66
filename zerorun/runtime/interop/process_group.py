"""A script's own `torch.distributed.destroy_process_group()` first finishes the engines' collectives.

A DDP habit ends training with `dist.destroy_process_group()`. After the last `step()` a deferred publish
or a prefetch may still be on the wire, and gloo aborts a process whose group is torn down under a
running collective. The launcher's worker holds this wrapper for the run of the script (installed before
the script is imported, which may bind the function then; removed when the script returns).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch.distributed as dist

from zerorun.runtime.interop import engines
from zerorun.runtime.interop.patches import AttributePatch


def _settled(destroy: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(destroy)
    def settled_destroy(*args: Any, **kwargs: Any) -> Any:
        engines.settle_all()
        return destroy(*args, **kwargs)
    return settled_destroy


_PATCH = AttributePatch(dist, "destroy_process_group", _settled)


def hold() -> Callable[[], None]:
    """Settle the engines before `dist.destroy_process_group()` until the returned release is called."""
    return _PATCH.hold()
