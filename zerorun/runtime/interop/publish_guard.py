"""The root module's `parameters()` and `named_parameters()` wait for a deferred publish in flight.

A DDP habit (an EMA of the weights, a weight-norm log, `AveragedModel.update_parameters(model)`)
reads the root's parameters right after `step()`; with `zero.overlap_publish` the post-step all-gather
may still be landing (runtime/deferred_publish.py), and the habit would read half-gathered values.
torch has no hook on `parameters()`, and an instance attribute would be carried by every copy of the
model (pointing at the original). So, as FSDP2's `fully_shard` does, the root's class is swapped for a
subclass of the same name, made for this engine: `isinstance`, printing and the class name Hugging Face
saves are unchanged; a copy or a pickle of the model is of the original class. `remove()` (the engine's
destroy, or its garbage collection) sets the original class back.
"""

from __future__ import annotations

import copyreg
import logging
import weakref
from typing import Any, Callable, Iterator

from torch import nn

log = logging.getLogger("zerorun")


def guard_parameter_reads(root: nn.Module, wait_all: Callable[[], None]) -> Callable[[], None]:
    """Swap `root`'s class for one whose `named_parameters()` first calls `wait_all`; returns the undo."""
    base = type(root)
    guarded = type(base.__name__, (base,), {
        "named_parameters": _named_parameters_after(wait_all), "__reduce_ex__": _reduce_as_base,
        "__module__": base.__module__, "__qualname__": base.__qualname__, "_zerorun_guard_of": base})
    root.__class__ = guarded
    held = weakref.ref(root)

    def remove() -> None:
        module = held()
        if module is None:
            return
        if type(module) is guarded:
            module.__class__ = base
        else:  # the script or another library swapped it again since: theirs stays
            log.warning("zerorun: the class of the model's root changed while zerorun's publish guard was on; "
                        "left as %s", type(module).__qualname__)
    return remove


def _named_parameters_after(wait_all: Callable[[], None]) -> Callable[..., Iterator[tuple[str, nn.Parameter]]]:
    def named_parameters(self: nn.Module, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        wait_all()
        base: type[nn.Module] = type(self).__mro__[1]
        return base.named_parameters(self, *args, **kwargs)
    return named_parameters


def _reduce_as_base(self: nn.Module, protocol: int) -> tuple[Any, ...]:
    """Copies and pickles are of the original class (a pickle cannot name the guarded one)."""
    base = type(self).__mro__[1]
    return copyreg._reconstructor, (base, object, None), self.__getstate__()  # type: ignore[attr-defined]  # what pickle protocols 0-1 use: object.__new__(base), then the state
