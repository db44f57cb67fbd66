"""Numeric policy: which dtype each kind of state has, and the fp16 dynamic loss scaler.

| state                   | fp32 | bf16 | fp16              |
|-------------------------|------|------|-------------------|
| parameters, activations | fp32 | bf16 | fp16              |
| gradients as produced   | fp32 | bf16 | fp16 (scaled)     |
| gradient accumulation and reduction | fp32 | fp32 | fp32 (scaled) |
| master weights, moments | fp32 (the parameters themselves) | fp32 | fp32 |

Gradients are accumulated and reduced in fp32 whatever the compute dtype: accumulating bf16
micro-batch gradients in bf16 loses bits on every add, and the shard a rank keeps (stage 2) is
only 1/N of the model, so fp32 there costs little memory. `zero.reduce_dtype: bf16` (DeepSpeed's
`data_types.grad_accum_dtype: bf16`) chooses bf16 instead, for any compute dtype: half the bytes
on the link and in the gradient buffers, each accumulation and each sum across ranks rounded to
bf16; the optimizer still divides and steps in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zerorun.config import PrecisionConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes of each kind of state."""

    param_dtype: torch.dtype = torch.float32
    reduce_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(cls, cfg: PrecisionConfig, reduce_dtype: str = "fp32") -> PrecisionPolicy:
        """`reduce_dtype`: the recipe's `zero.reduce_dtype`."""
        return cls(param_dtype=DTYPES[cfg.dtype], reduce_dtype=DTYPES[reduce_dtype])


class LossScaler:
    """Dynamic loss scaling for fp16 (a fixed scale of 1 otherwise), as torch's GradScaler does.

    After `growth_interval` steps without overflow the scale grows by `growth_factor`; an
    overflow multiplies it by `backoff_factor` (never below `min_loss_scale`) and the step is
    skipped on every rank. `hysteresis` > 1 (DeepSpeed's delayed shift) lets that many overflows
    in a row pass before the scale backs off (the steps are still skipped); the count refills when
    the scale grows, or after every clean step with `consecutive_hysteresis`.
    `dynamic_loss_scale: false` keeps `initial_loss_scale` for the whole run.
    """

    def __init__(self, cfg: PrecisionConfig) -> None:
        self.dynamic = cfg.dtype == "fp16" and cfg.dynamic_loss_scale
        self.scale = cfg.initial_loss_scale if cfg.dtype == "fp16" else 1.0
        self.growth_interval = cfg.growth_interval
        self.growth_factor = cfg.growth_factor
        self.backoff_factor = cfg.backoff_factor
        self.min_scale = cfg.min_loss_scale
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self._good_steps = 0
        self._hysteresis_left = cfg.hysteresis

    def update(self, found_inf: bool) -> None:
        if not self.dynamic:
            return
        if found_inf:
            self._good_steps = 0
            if self._hysteresis_left > 1:
                self._hysteresis_left -= 1
                return
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self._good_steps += 1
        if self.consecutive_hysteresis:
            self._hysteresis_left = self.hysteresis
        if self._good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self._good_steps = 0
            self._hysteresis_left = self.hysteresis

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self._good_steps, "hysteresis_left": self._hysteresis_left}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._good_steps = int(state["good_steps"])
        # checkpoints written before hysteresis existed had none left to spend
        self._hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
