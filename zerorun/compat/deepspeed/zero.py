"""`deepspeed.zero`: `Init` builds a model shard by shard at stage 3 (zerorun.sharded_init), and
`GatheredParameters` gives full parameters inside a block, as transformers' `from_pretrained`,
weight initialisation and `resize_token_embeddings` use them.

    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        model = Model(config)                       # stage 3: meta parameters, initialisation recorded
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        if rank == 0:
            load(params)                            # written back to every rank's shard on exit

Before `deepspeed.initialize` there are no shards yet, and the parameters `Init` made stay meta
tensors: as in DeepSpeed, where a partitioned parameter outside a gathering block is an empty
tensor, a write to one there changes nothing (transformers relies on this: it re-initialises
modules whose tied weight was loaded). The first gathering block replays the recorded
initialisation once into staged values (so every rank holds the whole model until `initialize`);
a block swaps its parameters' staged values in, and on exit with `modifier_rank` broadcasts that
rank's values to the others, keeps them staged and swaps the meta tensors back. The staged values
end the `Init` log as copies, so the engine's replay builds its shards from them. After
`initialize`, the block is the engine's `gathered(params, modify=modifier_rank is not None,
src=modifier_rank)`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.runtime import sharded_init


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
    return sharded_init.sharded_init()


def _stage(source: Any) -> int:
    """The ZeRO stage of a DeepSpeed config (a dict or a JSON path), else of the launched recipe."""
    import zerorun
    from zerorun import ds_config

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
    return _gathered_before_initialize(pending, modifier_rank)


_STAGED: dict[int, dict[Any, torch.Tensor]] = {}  # id(InitLog) -> {parameter: staged value}; logs live on in sharded_init


def _staged_values(params: list[torch.Tensor]) -> dict[Any, torch.Tensor]:
    """Each parameter's staged value, replaying (once) the `Init` logs that made them."""
    logs = sharded_init.logs_owning(params)
    found = {id(log): _STAGED.get(id(log)) for log in logs}
    for log in logs:
        if found[id(log)] is None:
            staged = found[id(log)] = _STAGED[id(log)] = {}
            log.replay(staged.__setitem__)
            for param, value in staged.items():  # the log now ends with the staged values (see the module doc)
                log.ops.append(sharded_init._Op(param, "copy_", torch.Tensor.copy_, (value,), {}))
    values = {p: v for staged in found.values() for p, v in staged.items()}
    missing = [p for p in params if p not in values]
    if missing:
        raise ZerorunError("deepspeed.zero.GatheredParameters: a parameter is still a meta tensor that no finished "
                           "zero.Init block created; gather it after the `with deepspeed.zero.Init()` block.")
    return values


@contextlib.contextmanager
def _gathered_before_initialize(params: list[torch.Tensor], modifier_rank: int | None) -> Iterator[None]:
    values = _staged_values(params)
    order = {p: i for i, p in enumerate(values)}  # creation order, the same on every rank (callers' may not be)
    params = sorted(params, key=order.__getitem__)
    for param in params:
        _swap(param, torch.nn.Parameter(values[param], requires_grad=param.requires_grad))
    try:
        yield
    finally:
        for param in params:
            value = param.data
            if modifier_rank is not None and dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(value, src=modifier_rank)
            values[param].copy_(value) if value is not values[param] else None
            _swap(param, torch.nn.Parameter(torch.empty_like(value, device="meta"), requires_grad=param.requires_grad))


def _swap(param: torch.Tensor, other: torch.Tensor) -> None:
    """Give `param` the contents of `other`, keeping its Python attributes (transformers' `_is_hf_initialized`)."""
    attributes = dict(param.__dict__)
    torch.utils.swap_tensors(param, other)
    param.__dict__.update(attributes)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.zero.{name} is not provided by zerorun's DeepSpeed compatibility: "
                         "zero.Init and zero.GatheredParameters cover stage 3's needs.")
