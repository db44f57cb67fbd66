"""`deepspeed.runtime.zero`: the same `Init` and `GatheredParameters` as `deepspeed.zero`."""

from __future__ import annotations

from zerorun.compat.deepspeed.zero import GatheredParameters, Init

__all__ = ["GatheredParameters", "Init"]
