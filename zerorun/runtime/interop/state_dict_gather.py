"""At stage 3, the model's own `state_dict()` holds whole parameters, gathered on every rank, as under DDP.

Stage 3 leaves each parameter of the script's model an empty tensor between its unit's gathers. A DDP habit saves
`model.state_dict()` (nanoGPT's `checkpoint = {'model': raw_model.state_dict(), ...}`): it would save a model of
empty tensors, and nothing would say so. So the root module gets a state-dict pre-hook and post-hook (registered
with the engine, removed with it): a call without `keep_vars` replaces each trainable parameter's entry by its
fp32 master, gathered one unit at a time (the same values `engine.state_dict()` gives rank 0). That gathers from
every rank, so every rank must call it, as every rank must run a forward; a call on rank 0 alone meets the
others' training collectives and stops the job naming both places (comm/places.py), instead of saving garbage.

`keep_vars=True` (zerorun's own checkpoints, `load_state_dict`'s bookkeeping) is left as torch makes it, and so is
a state dict of a module below the root (its units are gathered by the root's call only).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn


def gather_state_dicts(root: nn.Module, full_values: Callable[[nn.Module], dict[str, torch.Tensor]]) -> Callable[[], None]:
    """Make `root.state_dict()` take its trainable entries from `full_values(root)`; returns the undo."""
    calls: list[bool] = []  # keep_vars of the calls in progress (a state dict may call another inside)

    def before(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        calls.append(keep_vars)

    def after(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        keep_vars = calls.pop() if calls else True
        if keep_vars:
            return
        for name, value in full_values(module).items():
            if prefix + name in state:
                state[prefix + name] = value

    handles = [root.register_state_dict_pre_hook(before), root.register_state_dict_post_hook(after)]

    def remove() -> None:
        for handle in handles:
            handle.remove()
    return remove
