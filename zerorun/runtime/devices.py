"""Moving the user's model and batches onto the rank's device: the engine's setup and every forward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def to_device(model: nn.Module, device: torch.device) -> nn.Module:
    """Move buffers and frozen parameters to `device`. Trainable parameters are the store's to place: it copies
    them into its flat buffers (or shards) a unit at a time, so a model built in host memory is never whole on
    the GPU (`sharded_init`'s meta parameters are replayed by the store too)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)
        for param in module._parameters.values():
            if param is not None and not param.requires_grad and not param.is_meta and param.device != device:
                param.data = param.data.to(device)
    return model


def place_inputs(obj: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Tensors in (nested lists, tuples, dicts of) `obj` on `device`; floating ones in `dtype` unless it is fp32.

    A batch built on the CPU (a data loader without `.to(device)`) would otherwise stop the first
    forward on a GPU with torch's "Expected all tensors to be on the same device"."""
    if isinstance(obj, torch.Tensor):
        cast = dtype if dtype != torch.float32 and obj.is_floating_point() else None
        if obj.device == device and cast in (None, obj.dtype):
            return obj
        return obj.to(device=device, dtype=cast, non_blocking=obj.device.type == "cpu" and obj.is_pinned())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(place_inputs(o, device, dtype) for o in obj)
    if isinstance(obj, tuple):  # a namedtuple
        return type(obj)(*(place_inputs(o, device, dtype) for o in obj))
    if isinstance(obj, dict):
        return {k: place_inputs(v, device, dtype) for k, v in obj.items()}
    return obj
