"""Where a benchmarked step's seconds go, on rank 0: `zerorun bench step`'s second table.

A step's wall time is compute plus whatever the training thread waits for. Three counters, taken
over the timed steps and divided by them, say which:

- **CPU, training thread**: forward, backward and optimizer compute, plus the collectives' own
  work done on that thread (quantizing, summing received pieces, copies).
- **CPU, other threads**: gloo's transport threads and the shared-memory worker, plus the kernel's
  network stack they drive. On a machine with fewer cores than threads this competes with compute.
- **bytes per level** (zerorun's systems): what rank 0's collectives moved within the node (shared
  memory) and across nodes (the backend), by zerorun's own count, payload only (with qwZ/qgZ, the
  int8 values and scales that crossed).
- **blocked in wait()**, per collective kind (zerorun's systems only): the communication compute
  did not hide. For stages 1/2 the `all_gather` line is the publish, waited for by the next
  forward's hooks (`zero.overlap_publish`) or inside `step()`.

The rest of the step is neither: the thread runnable but not running (another process or thread
had the core), or, for DDP/FSDP2/DeepSpeed, whose waits are not counted, waiting on their collectives.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

WAIT = "wait:"  # counter names for blocked-in-wait() seconds start with this, then the collective kind
LEVEL = "bytes:"  # then "node" (shared memory) or "network" (the backend: across nodes): zerorun's telemetry


def counters(comm_stats: Any | None) -> Callable[[], dict[str, float]]:
    """A snapshot of this process's counters; `comm_stats` is a zerorun engine's `CommStats` (None for peers)."""
    iface = os.environ.get("ZERORUN_BENCH_IFACE")  # set where the bench runs on an emulated cluster
    link = Path(f"/sys/class/net/{iface}/statistics/tx_bytes") if iface else None  # this node's own /sys

    def snapshot() -> dict[str, float]:
        values = {"cpu_main": time.thread_time(), "cpu_process": time.process_time()}
        if link is not None:
            values["link_bytes"] = float(link.read_text())
        if comm_stats is not None:
            values.update({WAIT + kind: seconds for kind, seconds in comm_stats.waited.items()})
            values.update({LEVEL + level: float(n) for level, n in comm_stats.level_bytes().items()})
        return values
    return snapshot


def per_step(before: dict[str, float], after: dict[str, float], steps: int) -> dict[str, float]:
    """Each counter's growth over the timed steps, per step (a kind first seen after `before` started at 0)."""
    return {name: (value - before.get(name, 0.0)) / steps for name, value in after.items()}


def profile_of(delta: dict[str, float]) -> dict[str, float]:
    """The profile columns from a per-step delta: main-thread CPU, other threads' CPU, waits per kind."""
    profile = {"cpu_main": delta["cpu_main"], "cpu_other": delta["cpu_process"] - delta["cpu_main"]}
    profile.update({name: value for name, value in delta.items() if name.startswith((WAIT, LEVEL))})
    return profile


def render(results: Sequence[Any], width: int | None = None) -> Any:
    """A rich table: per system, the step against its training thread's CPU, other threads' CPU and waits (fitted to
    `width` columns where given)."""
    from zerorun import tables

    kinds = sorted({name for r in results for name in (r.profile or {}) if name.startswith(WAIT)})
    table = tables.compact("where a step goes on rank 0 (seconds per step, medians; waits: blocked in wait(), "
                        "per collective)")
    for col in ("system", "step s", "CPU training thread", "CPU other threads (gloo, shm)",
                *(f"waited {k[len(WAIT):]}" for k in kinds), "rest (a peer's waits, or no core)",
                "rank 0 MB/step within the node / across (telemetry)"):
        table.add_column(col, justify="left" if col == "system" else "right", overflow="fold")
    for r in results:
        p = r.profile or {}
        if not p:
            continue
        waits = [p.get(k) for k in kinds]
        idle = r.step_s - p["cpu_main"] - sum(w for w in waits if w is not None)
        levels = (f"{p.get(LEVEL + 'node', 0) / 1e6:.0f} / {p.get(LEVEL + 'network', 0) / 1e6:.0f}"
                  if any(k.startswith(LEVEL) for k in p) else "-")
        table.add_row(r.system, f"{r.step_s:.2f}", f"{p['cpu_main']:.2f}", f"{p['cpu_other']:.2f}",
                      *("-" if w is None else f"{w:.2f}" for w in waits), f"{max(idle, 0.0):.2f}", levels)
    return tables.fitted(table, width, ("rank 0 MB/step within the node / across (telemetry)",), "--json FILE")
