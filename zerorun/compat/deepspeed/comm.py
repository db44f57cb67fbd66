"""`deepspeed.comm`: DeepSpeed's torch.distributed-style functions, served by torch.distributed itself."""

from __future__ import annotations

from typing import Any

import torch.distributed as _dist


def init_distributed(*args: Any, **kwargs: Any) -> Any:
    from zerorun.compat.api import init_distributed as _init

    return _init(*args, **kwargs)


def get_local_rank() -> int:
    import os

    return int(os.environ.get("LOCAL_RANK", "0"))


def __getattr__(name: str) -> Any:
    try:
        return getattr(_dist, name)  # get_rank, get_world_size, barrier, all_reduce, ReduceOp, ...
    except AttributeError:
        raise AttributeError(f"deepspeed.comm.{name} is not provided by zerorun's DeepSpeed compatibility "
                             "(it serves torch.distributed's functions).") from None
