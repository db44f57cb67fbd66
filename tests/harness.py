"""Run a function on N ranks of a gloo process group, collecting each rank's result or error.

    results = run_ranks(world_size=3, fn=train_and_report, args=(config,))

`fn(rank, world_size, *args)` runs in a fresh spawned process with torchrun's variables set
(so `zerorun.runtime.dist.init_distributed` finds them) and one CPU thread. A failure on any rank
is raised in the test with that rank's traceback; a hang is killed after `timeout` seconds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any, Callable

import pytest


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)
    try:
        queue.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """Run `fn` on `world_size` ranks; return the per-rank results in rank order."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, queue), daemon=True)
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            (results if ok else errors)[rank] = value
            if errors:
                break
    except Exception:  # queue.Empty: a rank hung or died without reporting
        errors[-1] = f"timed out after {timeout}s; ranks that reported: {sorted(results)}"
    finally:
        for proc in procs:
            proc.join(timeout=5 if not errors else 0.5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        rank, text = sorted(errors.items())[0]
        pytest.fail(f"rank {rank} failed:\n{text}", pytrace=False)
    return [results[r] for r in range(world_size)]
