"""`deepspeed.ops.adam`: DeepSpeed's Adam classes as torch optimizers that zerorun's engine takes over.

accelerate turns a script's torch AdamW into `DeepSpeedCPUAdam` when the DeepSpeed config offloads the
optimizer; DeepSpeed scripts build `FusedAdam` themselves. zerorun steps its own kernel on whichever
home the recipe gives the states (`zero.offload_optimizer`), so each class here only records the
param groups and hyper-parameters, as a torch Adam (L2 added to the gradient) or AdamW (decoupled
decay), the way DeepSpeed's `adamw_mode` chooses.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from zerorun.errors import ZerorunError


def _adam(params: Iterable[Any], lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
          adamw_mode: bool, amsgrad: bool, bias_correction: bool) -> torch.optim.Optimizer:
    if not bias_correction:
        raise ZerorunError("deepspeed.ops.adam with bias_correction=False is not provided by zerorun: torch's Adam, "
                           "which it stands for, always corrects the bias.")
    cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad)


class DeepSpeedCPUAdam(torch.optim.AdamW):
    """DeepSpeed's CPU Adam: the recipe's `zero.offload_optimizer.device: cpu` decides where zerorun steps it."""

    def __new__(cls, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> Any:
        return _adam(model_params, lr, betas, eps, weight_decay, adamw_mode, amsgrad, bias_correction)


class FusedAdam(torch.optim.AdamW):
    """DeepSpeed's fused GPU Adam: zerorun picks its own fused kernel for the engine's device."""

    def __new__(cls, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> Any:
        return _adam(params, lr, betas, eps, weight_decay, adam_w_mode, amsgrad, bias_correction)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.ops.adam.{name} is not provided by zerorun's DeepSpeed compatibility "
                         "(it serves DeepSpeedCPUAdam and FusedAdam).")
