"""`deepspeed.zero`: `Init` builds a model shard by shard at stage 3 (zerorun.sharded_init)."""

from __future__ import annotations

import contextlib
from typing import Any


def Init(module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,  # noqa: N802
         remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
         config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None, **unused: Any) -> Any:
    """Context manager: at stage 3 (the launched recipe's), parameters are created as shards."""
    import zerorun

    if module is not None:
        raise NotImplementedError("deepspeed.zero.Init(module=...) (partitioning a built model) is not provided by "
                                  "zerorun: build the model inside `with deepspeed.zero.Init():` instead.")
    if not enabled or zerorun.recipe().zero.stage != 3:
        return contextlib.nullcontext()
    return zerorun.sharded_init()


def __getattr__(name: str) -> Any:
    hint = {"GatheredParameters": "engine.engine.gathered(params, modify=True, src=0)"}.get(
        name, "zerorun.sharded_init() and engine.engine.gathered() cover stage 3's needs")
    raise AttributeError(f"deepspeed.zero.{name} is not provided by zerorun's DeepSpeed compatibility: use {hint}.")
