"""DeepSpeed's learning-rate schedules, with its formulas and its stepping convention.

    schedule = build(recipe.scheduler, engine.optimizer, default_total=recipe.train.steps)
    ...
    schedule.step()          # after every applied optimizer step (not after a skipped fp16 step)

As in DeepSpeed 0.19.8 (`deepspeed/runtime/lr_schedules.py`), a schedule counts `last_batch_iteration`
from -1; building it sets the lr for iteration -1 (WarmupLR: warmup_min_lr), and each `step()`
advances the iteration and writes the new lr into every param group. So with the engine stepping it
after each update, update k (from 0) runs with the lr of iteration k - 1. Warmup schedules use at
least 2 warmup steps (DeepSpeed's `max(2, warmup_num_steps)`), and the log warmup rises as
log(iteration + 1) / log(warmup steps). OneCycle also cycles beta1 inversely to the lr.

Each schedule is a pure function `lr_at(iteration) -> factor or lr` over a small shared base that
does the stepping, the param-group writes and the state dict (what checkpoints keep).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from zerorun.config import SchedulerConfig


class Schedule:
    """The stepping shared by every schedule: iteration count, writing lrs, state dict."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] = []
        if last_batch_iteration == -1:
            self._write()

    @property
    def last_epoch(self) -> int:
        """torch's name for the step count (zerorun's engine reads it to track who stepped the schedule)."""
        return self.last_batch_iteration

    def lrs(self) -> list[float]:
        """The lr of every param group at `last_batch_iteration`."""
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lrs()

    def get_last_lr(self) -> list[float]:
        assert self._last_lr, "need to call step() first"
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._write()

    def _write(self) -> None:
        self._last_lr = self.lrs()
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]


def warmup_gamma(iteration: int, warmup_steps: int, warmup_type: str) -> float:
    """How far through the warmup `iteration` is, 0 -> 1 (DeepSpeed's log or linear rise)."""
    if warmup_type == "log":
        return math.log(iteration + 1) / math.log(warmup_steps)
    return iteration / warmup_steps


class WarmupLR(Schedule):
    """warmup_min_lr -> warmup_max_lr over warmup_num_steps, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.min_lr = warmup_min_lr
        # DeepSpeed: no warmup_max_lr means each group's own lr (a single group's here)
        self.max_lr = optimizer.param_groups[0]["lr"] if warmup_max_lr is None else warmup_max_lr
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return warmup_gamma(self.last_batch_iteration, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lrs(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [self.min_lr] * len(self.optimizer.param_groups)
        return [self.min_lr + (self.max_lr - self.min_lr) * self.gamma()] * len(self.optimizer.param_groups)


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_lr: float = 0.0,
                 warmup_max_lr: float | None = None, warmup_num_steps: int = 1000, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def gamma(self) -> float:
        if self.last_batch_iteration < self.warmup_num_steps:
            return super().gamma()
        remaining = float(self.total_num_steps - self.last_batch_iteration)
        return max(0.0, remaining / float(max(1.0, self.total_num_steps - self.warmup_num_steps)))


class WarmupCosineLR(Schedule):
    """A fraction of each group's own lr: warmup_min_ratio -> 1, then a cosine down to cos_min_ratio."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio, self.cos_min_ratio = warmup_min_ratio, cos_min_ratio
        self.warmup_num_steps = max(2, warmup_num_steps)
        self.warmup_type = warmup_type
        self.org_lrs = [group["lr"] for group in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            rise = warmup_gamma(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + rise * (1.0 - self.warmup_min_ratio)
        done = it - self.warmup_num_steps + 1
        progress = min(1.0, done / max(1, self.total_num_steps - self.warmup_num_steps))  # stays at the floor after
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lrs(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [0.0] * len(self.org_lrs)
        return [lr * self.ratio() for lr in self.org_lrs]


class OneCycle(Schedule):
    """Up from cycle_min_lr to cycle_max_lr and back over the cycle, then an optional decay; beta1 the other way."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float, cycle_max_lr: float,
                 decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000, cycle_second_step_size: int | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True, cycle_min_mom: float = 0.8,
                 cycle_max_mom: float = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        self.first_size, self.second_size = first, second
        self.total_size, self.step_ratio = first + second, first / (first + second)
        self.first_stairs = cycle_first_stair_count
        self.second_stairs = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lr, self.max_lr, self.decay_lr_rate = cycle_min_lr, cycle_max_lr, decay_lr_rate
        self.min_mom, self.max_mom, self.decay_mom_rate = cycle_min_mom, cycle_max_mom, decay_mom_rate
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        n = len(optimizer.param_groups)
        if last_batch_iteration == -1:  # DeepSpeed starts at the cycle's bottom, beta1 at cycle_min_mom
            for group in optimizer.param_groups:
                group["lr"] = cycle_min_lr
                if self.cycle_momentum:
                    group["betas"] = (cycle_min_mom, 0.99)
        self.optimizer, self.last_batch_iteration, self._last_lr = optimizer, last_batch_iteration, [cycle_min_lr] * n

    def _scale(self) -> float:
        """Where in the cycle the next iteration is, 0 (bottom) -> 1 (top) -> 0; in stairs when asked."""
        it = self.last_batch_iteration + 1
        x = 1.0 + it / self.total_size - math.floor(1 + it / self.total_size)
        rising = x <= self.step_ratio
        scale = x / self.step_ratio if rising else (x - 1) / (self.step_ratio - 1)
        stairs = self.first_stairs if rising else self.second_stairs
        if stairs > 0:  # DeepSpeed quantises from the integer offset in the cycle, not from `scale`
            offset = it % self.total_size
            if offset <= self.first_size:
                position = offset * stairs / self.first_size
            else:
                position = (self.total_size - offset) * stairs / self.second_size
            scale = math.floor(position) / stairs
        return scale

    def _decay_interval(self) -> float | None:
        """Decay intervals done after the cycle; None while cycling or when decay is off."""
        if self.last_batch_iteration < self.total_size or math.isclose(self.decay_step_size, 0):
            return None
        return (self.last_batch_iteration - self.total_size + 1) / self.decay_step_size

    def lrs(self) -> list[float]:
        n = len(self.optimizer.param_groups)
        if self.last_batch_iteration < self.total_size:
            return [self.min_lr + (self.max_lr - self.min_lr) * self._scale()] * n
        interval = self._decay_interval()
        if interval is None or math.isclose(self.decay_lr_rate, 0):
            return [self.min_lr] * n
        return [self.min_lr / (1 + self.decay_lr_rate * interval)] * n

    def beta1(self) -> float:
        if self.last_batch_iteration < self.total_size:
            return self.max_mom - (self.max_mom - self.min_mom) * self._scale()
        interval = self._decay_interval()
        if interval is None or math.isclose(self.decay_mom_rate, 0):
            return self.max_mom
        return self.max_mom * (1 + self.decay_mom_rate * interval)

    def _write(self) -> None:
        super()._write()
        if self.cycle_momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.beta1(), 0.99)


class LRRangeTest(Schedule):
    """lr_range_test_min_lr x (1 + rate x intervals): a rising lr to find where training diverges."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        self.min_lr, self.step_size, self.rate = lr_range_test_min_lr, lr_range_test_step_size, lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        if last_batch_iteration == -1:
            for group in optimizer.param_groups:
                group["lr"] = lr_range_test_min_lr
        self.optimizer, self.last_batch_iteration = optimizer, last_batch_iteration
        self._last_lr = [lr_range_test_min_lr] * len(optimizer.param_groups)

    def lrs(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [self.min_lr * (1 + self.rate * interval)] * len(self.optimizer.param_groups)


def build(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, default_total: int) -> Schedule | None:
    """The recipe's `scheduler` over `optimizer` (None for type none); total_num_steps defaults to train.steps."""
    total = cfg.total_num_steps or default_total
    warmup: dict[str, Any] = dict(warmup_num_steps=cfg.warmup_num_steps, warmup_type=cfg.warmup_type)
    if cfg.type == "none":
        return None
    if cfg.type == "WarmupLR":
        return WarmupLR(optimizer, cfg.warmup_min_lr, cfg.warmup_max_lr, **warmup)
    if cfg.type == "WarmupDecayLR":
        return WarmupDecayLR(optimizer, total, cfg.warmup_min_lr, cfg.warmup_max_lr, **warmup)
    if cfg.type == "WarmupCosineLR":
        return WarmupCosineLR(optimizer, total, cfg.warmup_min_ratio, cfg.warmup_num_steps, cfg.cos_min_ratio,
                              cfg.warmup_type)
    if cfg.type == "OneCycle":
        return OneCycle(optimizer, cfg.cycle_min_lr, cfg.cycle_max_lr, cfg.decay_lr_rate, cfg.cycle_first_step_size,
                        cfg.cycle_second_step_size, cfg.cycle_first_stair_count, cfg.cycle_second_stair_count,
                        cfg.decay_step_size, cfg.cycle_momentum, cfg.cycle_min_mom, cfg.cycle_max_mom,
                        cfg.decay_mom_rate)
    assert cfg.type == "LRRangeTest", f"schedulers.build: unhandled type {cfg.type}"
    return LRRangeTest(optimizer, cfg.lr_range_test_min_lr, cfg.lr_range_test_step_size,
                       cfg.lr_range_test_step_rate, cfg.lr_range_test_staircase)
