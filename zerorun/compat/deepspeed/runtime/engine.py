"""`deepspeed.runtime.engine.DeepSpeedEngine`: the class `deepspeed.initialize` returns (zerorun.compat.engine)."""

from __future__ import annotations

from zerorun.compat.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
