"""The script's own LR schedulers on the engine's optimizers, found without the script's help.

A DDP script builds `LambdaLR(optimizer, ...)` and steps it itself; it never tells anyone the scheduler
exists. A resume that did not restore it would start the warm-up again, silently, so the engine must
find it (optim/lr_schedules.py saves and restores what this returns). torch keeps no list of the
schedulers of an optimizer and offers no hook when one is built: the scheduler holds the optimizer,
not the other way round. So the only ways to find it are to patch `LRScheduler.__init__` (a change to a
torch class for the whole process) or to ask the garbage collector what refers to the optimizer.
zerorun does the second: `gc.get_referrers` reads, and changes nothing, in torch or in the script's
objects. It scans every tracked object, so it runs at the first update, at saves and while a restore
waits, never every step. A script that would rather say it: hand the scheduler to
`zerorun.initialize(lr_scheduler=...)` (the engine then steps it) or keep it out of the engine's
optimizers (its state is then the script's to save, e.g. in `engine.client_state`).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler


def schedulers_of(optimizers: list[torch.optim.Optimizer]) -> list[Any]:
    """The top-level LR schedulers built on any of `optimizers` (children of a SequentialLR left out)."""
    referrers = gc.get_referrers(*optimizers)
    # A scheduler may refer through its __dict__ (always before Python 3.11; from 3.11 once something, such as its
    # state_dict(), has asked for it): only a dict whose "optimizer" is one of them can be a scheduler's, and any
    # other (the script's, the engine's) would cost a second scan of the heap for nothing.
    dicts = [obj for obj in referrers if type(obj) is dict and any(obj.get("optimizer") is o for o in optimizers)]
    owners = [obj for obj in gc.get_referrers(*dicts)
              if isinstance(obj, LRScheduler) and any(obj.__dict__ is d for d in dicts)] if dicts else []
    found = [obj for obj in referrers + owners
             if isinstance(obj, LRScheduler) and any(obj.optimizer is o for o in optimizers)]
    children = {id(child) for s in found for child in getattr(s, "_schedulers", [])}
    unique: dict[int, Any] = {}
    for s in found:
        if id(s) not in children:
            unique.setdefault(id(s), s)
    return list(unique.values())
