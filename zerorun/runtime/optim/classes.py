"""Optimizers that torch lacks and recipes or DeepSpeed configs name: Lion and LAMB, as torch optimizers.

Both are ordinary `torch.optim.Optimizer`s a script may also use itself (`zerorun.Lion`, `zerorun.Lamb`);
the engine runs them as any other (ways.py): Lion is elementwise (declared so), LAMB scales each
parameter's step by that parameter's norms, so it runs on whole parameters (the owner way). The
formulas are DeepSpeed's (`deepspeed.ops.lion`, `FusedLamb`), so a DeepSpeed config that names them
trains the same update.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from zerorun.runtime.optim.ways import Elementwise


class Lion(Elementwise, torch.optim.Optimizer):
    """Lion (Chen et al., 2023): the sign of an interpolated momentum, decoupled weight decay.

        update = sign(beta1 * m + (1 - beta1) * g);  p = p * (1 - lr * wd) - lr * update
        m = beta2 * m + (1 - beta2) * g
    """

    def __init__(self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None if closure is None else _closure_loss(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in (p for p in group["params"] if p.grad is not None):
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                exp_avg = state["exp_avg"]
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


class Lamb(torch.optim.Optimizer):
    """LAMB (You et al., 2019) as DeepSpeed's FusedLamb computes it: an Adam step with L2 decay added to it, scaled
    per parameter by ||p|| / ||step||, clamped to [min_coeff, max_coeff] (1 when either norm is 0)."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, bias_correction: bool = True, max_coeff: float = 10.0,
                 min_coeff: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, max_coeff=max_coeff, min_coeff=min_coeff))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None if closure is None else _closure_loss(closure)
        for group in self.param_groups:
            for p in (p for p in group["params"] if p.grad is not None):
                self._update(p, group)
        return loss

    def _update(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        state = self.state[p]
        if not state:
            state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        exp_avg, exp_avg_sq, step = state["exp_avg"], state["exp_avg_sq"], float(state["step"])
        exp_avg.mul_(beta1).add_(p.grad, alpha=1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
        if group["bias_correction"]:
            update = (exp_avg / (1 - beta1 ** step)) / ((exp_avg_sq / (1 - beta2 ** step)).sqrt() + group["eps"])
        else:
            update = exp_avg / (exp_avg_sq.sqrt() + group["eps"])
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        weight_norm, update_norm = float(p.norm()), float(update.norm())
        coeff = 1.0
        if weight_norm > 0 and update_norm > 0:
            coeff = min(max(weight_norm / update_norm, group["min_coeff"]), group["max_coeff"])
        p.add_(update, alpha=-group["lr"] * coeff)


def _closure_loss(closure: Callable[[], Any]) -> Any:
    with torch.enable_grad():
        return closure()
