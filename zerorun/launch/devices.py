"""A node's GPUs: how many there are, and which of them a node's slots mean.

Slots are indices into the GPUs *the node itself* sees, decided on the node, never on the
launcher: a launcher on a login node or a laptop without GPUs plans `--include host:0,2` as slots
(0, 2), and the node supervisor there turns them into `CUDA_VISIBLE_DEVICES` (`visible_devices`).
Where the node already restricts its GPUs (`CUDA_VISIBLE_DEVICES=2,3,5` in its environment, or
in the recipe's `env`), slot i is the i-th of those: slots (0, 2) become `2,5`. A node without
CUDA leaves the variable alone; its slots only count workers.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

from zerorun.errors import LaunchError

VISIBLE = "CUDA_VISIBLE_DEVICES"


def gpu_count() -> int:
    """CUDA (or ROCm) devices here; 0 without importing torch where no GPU driver is present (that import takes seconds)."""
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/kfd")) and not glob.glob("/dev/nvidia[0-9]*"):
        return 0
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def visible_devices(host: str, slots: Sequence[int], visible: str | None, gpus: int,
                    share: bool = False) -> str | None:
    """`CUDA_VISIBLE_DEVICES` for a node's `slots`: None where the node has no GPU (`gpus` is what
    CUDA counts there, already narrowed by `visible`, the variable the node inherited).

    `share` (launch.backend: gloo): slots beyond the node's GPUs wrap around onto them, each GPU
    listed once; a rank then takes GPU `local_rank % count` (`runtime.dist.pick_device`)."""
    if gpus == 0:
        return None
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(gpus)]
    devices = devices[:gpus]
    if share:
        return ",".join(dict.fromkeys(devices[slot % len(devices)] for slot in slots))
    missing = [slot for slot in slots if slot >= len(devices)]
    if missing:
        seen = f"{VISIBLE}={visible} leaves {len(devices)}" if visible else f"it has {len(devices)}"
        raise LaunchError(f"host {host}: slot {missing[0]} does not exist: {seen} GPU(s); use fewer slots (hostfile "
                          f"slots=, --include/--exclude, --num-gpus, nproc_per_node) or widen {VISIBLE}. To run "
                          f"several ranks on one GPU (tests, debugging), set launch.backend: gloo.")
    return ",".join(devices[slot] for slot in slots)
