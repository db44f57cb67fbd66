"""`deepspeed.zero`: `Init` builds a model shard by shard at stage 3 (zerorun.sharded_init), and
`GatheredParameters` gives full parameters inside a block, as transformers' `from_pretrained`,
weight initialisation and `resize_token_embeddings` use them.

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Model(config)                       # stage 3: meta parameters, initialisation recorded
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            load(params)                            # written back to every rank's shard on exit

Before `deepspeed.initialize` there are no shards yet: the parameters `Init` made stay meta tensors
(a write to one outside a block changes nothing, as in DeepSpeed), and each rank keeps its piece
of their values (`zerorun.compat.staged_params`); a block gathers them whole. After `initialize`,
the block is the engine's `gathered(params, modify=modifier_rank is not None, src=modifier_rank)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from zerorun.compat import staged_params


def Init(module: Any = None, data_parallel_group: Any = None, mem_efficient_linear: bool = True,  # noqa: N802
         remote_device: str | None = None, pin_memory: bool = False, config_dict_or_path: Any = None,
         config: Any = None, enabled: bool = True, dtype: Any = None, mpu: Any = None, **unused: Any) -> Any:
    """Context manager: at stage 3 (the given DeepSpeed config's, else the launched recipe's), parameters
    are created as shards."""
    if module is not None:
        raise NotImplementedError("deepspeed.zero.Init(module=...) (partitioning a built model) is not provided by "
                                  "zerorun: build the model inside `with deepspeed.zero.Init():` instead.")
    if not enabled or _stage(config_dict_or_path if config_dict_or_path is not None else config) != 3:
        return contextlib.nullcontext()
    import zerorun

    return zerorun.sharded_init()


def _stage(source: Any) -> int:
    """The ZeRO stage of a DeepSpeed config (a dict or a JSON path), else of the launched recipe."""
    import zerorun
    from zerorun.config import ds_config

    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        source = ds_config.load_json(source)
    if isinstance(source, Mapping):
        return int((source.get("zero_optimization") or {}).get("stage", 0))
    return zerorun.recipe().zero.stage


def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> Any:
    """Context manager: `params` whole inside; with `modifier_rank`, that rank's values are kept on exit."""
    from zerorun.compat.engine import engine_owning

    if not enabled or params is None:
        return contextlib.nullcontext()
    wanted = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
    engine = engine_owning(wanted)
    if engine is not None:
        return engine.gathered(wanted, modify=modifier_rank is not None, src=modifier_rank or 0)
    pending = [p for p in wanted if p.is_meta]
    if not pending:
        return contextlib.nullcontext()
    return staged_params.gathered(pending, modifier_rank)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.zero.{name} is not provided by zerorun's DeepSpeed compatibility: "
                         "zero.Init and zero.GatheredParameters cover stage 3's needs.")
