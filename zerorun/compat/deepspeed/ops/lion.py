"""`deepspeed.ops.lion`: DeepSpeed's Lion classes as zerorun's Lion (DeepSpeed's formula), which zerorun runs over
each rank's shard wherever the recipe puts the state; accelerate asks for it when a Lion is offloaded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerorun.runtime.optim.classes import Lion


class DeepSpeedCPULion(Lion):
    """DeepSpeed's CPU Lion."""

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                weight_decay: float = 0, fp32_optimizer_states: bool = True) -> Any:
        return Lion(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(Lion):
    """DeepSpeed's fused GPU Lion."""

    def __new__(cls, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                weight_decay: float = 0.0, set_grad_none: bool = True) -> Any:
        return Lion(params, lr=lr, betas=betas, weight_decay=weight_decay)


__all__ = ["DeepSpeedCPULion", "FusedLion", "torch"]
