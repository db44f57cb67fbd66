"""Optimizer state entries as a checkpoint manifest writes them (JSON), and back.

An optimizer's state holds tensors and plain values. Tensors with elements go to the rank files
(safetensors); what the manifest keeps is how to rebuild the rest: a flat group's scalars (one value
per group, such as `step`, a 0-d tensor in torch's optimizers) and, for an owned parameter, which of
its entries are tensors (and their dtype and shape) and the values of the others.
"""

from __future__ import annotations

from typing import Any

import torch

from zerorun.errors import ZerorunError

State = dict[str, Any]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ZerorunError(f"optimizer state of dtype {name!r} in a checkpoint manifest: not a torch dtype.")
    return dtype


def scalar_to_json(value: Any) -> dict[str, Any]:
    """One scalar: a 0-d tensor as its dtype and number, anything else as itself (it must be JSON)."""
    if isinstance(value, torch.Tensor):
        return {"tensor": str(value.dtype).removeprefix("torch."), "value": value.item()}
    if value is not None and not isinstance(value, (bool, int, float, str)):
        raise ZerorunError(f"optimizer state holds a {type(value).__name__} ({value!r}): zerorun saves tensors, "
                           "numbers and strings.")
    return {"value": value}


def scalar_from_json(entry: dict[str, Any]) -> Any:
    if "tensor" in entry:
        return torch.tensor(entry["value"], dtype=_dtype(entry["tensor"]))
    return entry["value"]


def scalars_to_json(scalars: State | None) -> dict[str, Any] | None:
    """A flat group's scalars (None: the group has not stepped)."""
    return None if scalars is None else {key: scalar_to_json(value) for key, value in scalars.items()}


def scalars_from_json(entries: dict[str, Any] | None) -> State | None:
    return None if entries is None else {key: scalar_from_json(entry) for key, entry in entries.items()}


def owned_to_json(state: State) -> dict[str, Any]:
    """An owned parameter's state: tensors by dtype and shape (their values are in the rank file), the rest by value."""
    return {key: {"tensor": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
            if isinstance(v, torch.Tensor) else scalar_to_json(v) for key, v in state.items()}


def is_tensor_entry(entry: dict[str, Any]) -> bool:
    """Whether an owned entry is a tensor stored in a rank file."""
    return "shape" in entry
