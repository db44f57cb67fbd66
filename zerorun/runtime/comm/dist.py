"""Process-group setup and device choice, shared by the worker bootstrap and the engine.

The worker (`zerorun.launch.worker`) calls `init_distributed` before the user's script runs; the
engine calls it too, so a script started by plain `torchrun` (or as a single process) also works.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zerorun.config import BACKEND_ENV
from zerorun.errors import ZerorunError

BACKENDS = ("auto", "nccl", "gloo")


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

    nccl on CUDA, gloo on CPU, unless `$ZERORUN_BACKEND` (the recipe's `launch.backend`) says
    otherwise. Without torchrun's variables this becomes a world of one on a private port, so the
    same script runs as a plain `python train.py`.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = choose_backend(device, os.environ.get(BACKEND_ENV, "auto"))
        if backend == "nccl":
            check_one_rank_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
        if "RANK" not in os.environ:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        kwargs: dict[str, Any] = {"backend": backend, "timeout": datetime.timedelta(seconds=timeout_s)}
        if device.type == "cuda":
            kwargs["device_id"] = device  # eager NCCL init: a bad device fails here, not in the first collective
        dist.init_process_group(**kwargs)
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, dist.get_backend())


def choose_backend(device: torch.device, requested: str) -> str:
    """The process-group backend for a rank on `device`: `requested` (auto, nccl or gloo) resolved."""
    requested = requested.strip().lower() or "auto"
    if requested not in BACKENDS:
        raise ZerorunError(f"{BACKEND_ENV}={requested} (launch.backend): expected one of {', '.join(BACKENDS)}.")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ZerorunError("launch.backend: nccl needs CUDA devices, and this rank has none (torch sees no GPU). "
                           "Use auto or gloo.")
    return requested


def check_one_rank_per_gpu(local_world: int, gpus: int) -> None:
    """NCCL gives each rank a GPU of its own: more ranks on a node than GPUs is refused before NCCL fails."""
    if local_world > gpus:
        raise ZerorunError(f"{local_world} ranks on this node but {gpus} GPU(s): NCCL runs one rank per GPU (two "
                           f"ranks on one GPU fail in NCCL's setup). Start at most {gpus} worker(s) per node "
                           f"(nproc_per_node, --num-gpus, hostfile slots), or set launch.backend: gloo to let ranks "
                           f"share a GPU (slower; for tests and debugging).")


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def joined(group: object) -> dist.ProcessGroup:
    """A group `dist.new_group` made that this rank is in, as a group: torch types its answer as the group or, for a
    rank outside it, a sentinel (-100), and the callers here keep only groups of their own rank."""
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"this rank is not in the process group it made ({group!r})")
    return group
