"""`zerorun bench comm`: the backend's own collectives against the ones zerorun uses instead.

This is the measurement behind `zerorun.runtime.comm.collectives`: on gloo a pairwise reduce-scatter and
a pairwise all-gather, against gloo's own and an all-reduce that keeps one
piece; ranks on one host do better still through shared memory (`zero.cpu_collectives`), measured
alongside, and ZeRO++'s block int8 ones (qgZ, qwZ) where the network is slow. `--cluster 2x1 --link 1gbit`
measures them across an emulated link instead of loopback.

Beside each time, the CPU the calling thread spent in it (launch and wait): in training that thread is the
one that computes, so this is what a collective takes from the forward and backward, where the rest of its
time hides under them.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerorun.bench.spawn import run_ranks


@dataclass
class CommResult:
    size_mib: float
    operation: str
    implementation: str
    median_ms: float
    caller_cpu_ms: float  # CPU time of the calling thread (the training thread in a real step), median


def _measure(rank: int, world: int, sizes_mib: list[float], repeats: int) -> list[CommResult]:
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    comm = Collectives()
    int8 = Collectives(quantized_gradients=True, quantized_weights=True)
    shm = Collectives(cpu="auto") if dist.get_backend() == "gloo" else None
    shm = shm if shm is not None and shm.shm is not None else None
    out = []
    for mib in sizes_mib:
        numel = int(mib * 2**20 / 4) // world * world
        full, shard = torch.randn(numel), torch.randn(numel // world)
        cases: list[tuple[str, str, Callable[[], Any]]] = [
            ("all-reduce", "backend all_reduce", lambda: dist.all_reduce(full)),
            ("reduce-scatter", "backend reduce_scatter_tensor", lambda: dist.reduce_scatter_tensor(shard, full)),
            ("reduce-scatter", "all_reduce + keep own piece", lambda: (dist.all_reduce(full),
                                                                        shard.copy_(full.view(world, -1)[rank]))),
            ("reduce-scatter", "zerorun", lambda: comm.reduce_scatter(full, shard).wait()),
            ("all-gather", "backend all_gather_into_tensor", lambda: dist.all_gather_into_tensor(full, shard)),
            ("all-gather", "zerorun", lambda: comm.all_gather(full).wait()),
            ("reduce-scatter", "zerorun int8 (qgZ)", lambda: int8.reduce_scatter(full, shard).wait()),
            ("all-gather", "zerorun int8 (qwZ)", lambda: int8.all_gather(full, compute_copy=True).wait()),
        ]
        if shm is not None:
            cases += [("all-reduce", "zerorun shared memory", lambda: shm.all_reduce(full).wait()),
                      ("reduce-scatter", "zerorun shared memory", lambda: shm.reduce_scatter(full, shard).wait()),
                      ("all-gather", "zerorun shared memory", lambda: shm.all_gather(full).wait())]
        for operation, impl, fn in cases:
            times, cpu = [], []
            for _ in range(repeats):
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.thread_time()
                fn()
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
            out.append(CommResult(mib, operation, impl, statistics.median(times) * 1e3, statistics.median(cpu) * 1e3))
    return out + _tag_costs(comm, shm, repeats)


def _tag_costs(comm: Any, shm: Any, repeats: int) -> list[CommResult]:
    """What the check of every collective's tag adds (runtime/comm/tags.py): on the wire, the fingerprint's
    all-reduce per collective; in shared memory, a tagged all-gather of one element per rank against an untagged
    one (the tag is written before and compared after the meeting)."""
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.wire import Op

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("the wire: one fingerprint all-reduce", lambda: comm.tags.on_wire(comm.tags.next(Op.ALL_GATHER, 1)))]
    if shm is not None:
        bare = Collectives(cpu="auto", tagged=False)
        tiny = torch.zeros(comm.world_size)
        cases += [("shared memory: a tagged 1-element all-gather", lambda: shm.all_gather(tiny).wait()),
                  ("shared memory: the same, untagged", lambda: bare.all_gather(tiny).wait())]
    out = []
    for implementation, fn in cases:
        times, cpu = [], []
        for _ in range(max(repeats, 200)):  # microseconds each: many, for a stable median
            start, start_cpu = time.perf_counter(), time.thread_time()
            fn()
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
        out.append(CommResult(0.0, "tag check", implementation, statistics.median(times) * 1e3,
                              statistics.median(cpu) * 1e3))
    return out


def run(sizes_mib: list[float], world_size: int = 2, repeats: int = 9, spawn: Any = None) -> list[CommResult]:
    """Rank 0's medians; `spawn(fn, args)` starts the ranks (default: `world_size` local processes)."""
    if spawn is not None:
        return spawn(_measure, (sizes_mib, repeats))[0]
    return run_ranks(_measure, world_size, (sizes_mib, repeats), timeout=1800)[0]


def render(results: list[CommResult], world_size: int, backend: str = "gloo", where: str = "") -> Any:
    from rich.table import Table

    table = Table(title=f"collectives on {backend}, {world_size} ranks{where}, fp32, median")
    for col in ("MiB", "operation", "implementation", "ms", "GB/s (buffer)", "caller's CPU ms"):
        table.add_column(col, justify="left" if col in ("operation", "implementation") else "right")
    for r in results:
        if r.operation == "tag check":  # microseconds, no bandwidth
            table.add_row("-", r.operation, r.implementation, f"{r.median_ms:.3f}", "-", f"{r.caller_cpu_ms:.3f}")
            continue
        table.add_row(f"{r.size_mib:g}", r.operation, r.implementation, f"{r.median_ms:.1f}",
                      f"{r.size_mib * 2**20 / (r.median_ms / 1e3) / 1e9:.2f}", f"{r.caller_cpu_ms:.1f}")
    return table
