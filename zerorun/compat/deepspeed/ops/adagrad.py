"""`deepspeed.ops.adagrad`: DeepSpeed's CPU Adagrad as torch's Adagrad, which zerorun runs over each rank's shard
wherever the recipe puts the state (`zero.offload_optimizer`); accelerate asks for it when an Adagrad is offloaded."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class DeepSpeedCPUAdagrad(torch.optim.Adagrad):
    """DeepSpeed's CPU Adagrad: torch's Adagrad with DeepSpeed's defaults."""

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-2, eps: float = 1e-10, weight_decay: float = 0,
                amsgrad: bool = False, fp32_optimizer_states: bool = True) -> Any:
        return torch.optim.Adagrad(model_params, lr=lr, eps=eps, weight_decay=weight_decay)
