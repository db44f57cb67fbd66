"""Process-group setup and device choice, shared by the worker bootstrap and the engine.

The worker (`zerorun.launch.worker`) calls `init_distributed` before the user's script runs; the
engine calls it too, so a script started by plain `torchrun` (or as a single process) also works.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    """Where this process stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def pick_device(local_rank: int) -> torch.device:
    """cuda:<local_rank> where CUDA exists (CUDA_VISIBLE_DEVICES already holds the node's slots), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 300.0) -> DistInfo:
    """Initialise the default process group from torchrun's environment (idempotent).

    nccl on CUDA, gloo on CPU. Without torchrun's variables this becomes a world of one on a
    private port, so the same script runs as a plain `python train.py`.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        kwargs = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device  # eager NCCL init: a bad device fails here, not in the first collective
        dist.init_process_group(**kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
