"""`deepspeed.checkpoint.utils`: what accelerate calls on a consolidated state dict before `torch.save`."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """Copies of the tensors in `item` (nested lists, tuples, dicts) on `device`: `torch.save` then writes
    each tensor's own values rather than the whole flat buffer a view shares."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
