"""The same setting in the script and in the recipe: said at run time where the two disagree.

A script ported from DDP keeps its own knobs (nanoGPT's `dtype` with an autocast, `max_iters`,
`gradient_accumulation_steps`) while the recipe has its own (`precision`, `train.steps`,
`train.grad_accum_steps`). docs/coming-from-ddp.md says which one wins for each pair; this module
watches the forwards for the two that zerorun cannot refuse up front, and warns once (rank 0):

- an autocast around the forward whose dtype is not `precision.dtype`: the parameters, gradients and
  their reduction follow the recipe, and only the ops inside the autocast follow the script;
- a step past `train.steps` where that number means something (the user gave it, or the recipe's LR
  schedule ends there): the script's loop decides how many steps run, and the progress total and the
  schedule were built for fewer.

The third pair, the script's accumulation against `train.grad_accum_steps`, is refused at the first window
where both count (`accumulation.AccumulationWindow`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zerorun.config import Recipe

log = logging.getLogger("zerorun")

SCHEDULES_TO_TRAIN_STEPS = ("WarmupDecayLR", "WarmupCosineLR")  # their total_num_steps: null means train.steps


@dataclass
class ScriptSettings:
    """What the recipe says of the two settings a script may also set itself, and what has been said."""

    dtype: torch.dtype  # precision.dtype, as the engine computes in
    steps: int | None  # train.steps where it means something, else None
    steps_why: str  # where that number comes from, and what uses it
    speak: bool  # rank 0 warns; the others stay quiet
    _said_dtype: bool = False
    _said_steps: bool = False

    def forward(self, global_step: int, device: torch.device) -> None:
        """At every forward, before the module runs: the script's autocast, and how far it has gone."""
        if not self.speak or (self._said_dtype and self._said_steps):
            return
        if not self._said_dtype and torch.is_autocast_enabled(device.type):
            autocast = torch.get_autocast_dtype(device.type)
            if autocast != self.dtype:
                self._said_dtype = True
                log.warning("zerorun: warning: the script's autocast runs the forward in %s while precision.dtype is "
                            "%s: the parameters, gradients and their reduction are %s (the recipe's precision "
                            "wins), and only the ops inside the autocast run in %s. Set precision to the dtype you "
                            "mean, and leave the autocast out (docs/coming-from-ddp.md).", _name(autocast),
                            _name(self.dtype), _name(self.dtype), _name(autocast))
        if not self._said_steps and self.steps is not None and global_step >= self.steps:
            self._said_steps = True
            log.warning("zerorun: warning: the script goes on to step %d, past train.steps: its own loop decides how "
                        "many steps run, but %s. Set train.steps to the script's count (docs/coming-from-ddp.md).",
                        global_step + 1, self.steps_why)


def watch(recipe: Recipe, dtype: torch.dtype, rank: int) -> ScriptSettings:
    """The recipe's side of the two settings, built once by the engine: `precision` as `dtype` (what the engine
    computes in), and `train.steps` where it means something (the user gave it, or the recipe's schedule ends there)."""
    train, scheduler = recipe.train, recipe.scheduler
    where = recipe.given.get("train.steps")
    ends_schedule = scheduler.type in SCHEDULES_TO_TRAIN_STEPS and scheduler.total_num_steps is None
    uses = ["the progress total"] if where else []
    uses += [f"the end of the recipe's {scheduler.type} schedule (scheduler.total_num_steps: null)"] \
        if ends_schedule else []
    why = f"train.steps = {train.steps} ({where or 'its default'}) sets {' and '.join(uses)}"
    return ScriptSettings(dtype, train.steps if uses else None, why, rank == 0)


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
