"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedules with its formulas (zerorun.runtime.optim.schedules).

accelerate reads `VALID_LR_SCHEDULES` to tell a DeepSpeed schedule (handed to `deepspeed.initialize`)
from a torch one (stepped by accelerate itself).
"""

from __future__ import annotations

from zerorun.config.ds_config import SCHEDULERS
from zerorun.runtime.optim.schedules import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR = (
    "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
VALID_LR_SCHEDULES = list(SCHEDULERS)

__all__ = ["LRRangeTest", "OneCycle", "VALID_LR_SCHEDULES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]
