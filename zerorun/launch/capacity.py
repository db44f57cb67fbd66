"""Before anything starts: do this machine's workers fit its cores and its memory?

On a CPU host every worker is a process with its own compute threads; more workers than cores
take turns on them, so every step waits for the slowest turn, and each worker carries its own copy
of torch in memory. `nproc_per_node: 64` on a 2-core machine once started 64 workers (17.4 GiB of
RSS, 99.6 s for 5 steps) and exited 0 without a word. So:

- **Cores.** On a machine without GPUs, more workers than usable cores (the CPU affinity mask, which
  containers and `taskset` narrow) is refused, naming the cores and the key that asked for the
  workers, unless `launch.oversubscribe: true` says it is meant (tests of 3 ranks on 2 cores,
  debugging). A GPU machine's workers drive GPUs and mostly wait on them: not checked.
- **Memory.** Whatever `oversubscribe` says, the workers must fit in the memory available to them
  (the kernel's MemAvailable, or a cgroup v2 limit's room when that is less). Each worker holds at
  least `WORKER_FLOOR_BYTES` of its own, and each node's torchrun and node supervisor
  `NODE_FLOOR_BYTES`, before the script allocates anything: a launch whose floor does not fit
  is certain to fail, so it is refused before it starts.

Only nodes on this machine are checked: the launcher knows nothing of another host's cores. `check`
is pure (the facts come in as `Machine`), so the test needs no 64-core or tiny machine.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from zerorun.errors import LaunchError
from zerorun.launch.plan import NodeCommand, is_local

MIB = 2**20
# Unique memory (USS: pages no other process shares; torch's libraries are shared and counted once)
# of one worker after importing torch and zerorun and stepping a tiny model: 148-150 MiB measured on
# torch 2.13 CPU; its output relay adds 7 MiB. A floor, rounded down: it refuses only what cannot fit.
# tests/launch/test_capacity.py measures a fresh interpreter with torch imported and checks the floor
# stays below it.
WORKER_FLOOR_BYTES = 128 * MIB
NODE_FLOOR_BYTES = 128 * MIB  # torchrun's agent (145 MiB USS measured) and zerorun's node supervisor (12 MiB)


@dataclass(frozen=True)
class Machine:
    """What the check needs to know about the launching machine."""

    cores: int  # usable CPU cores (the affinity mask)
    gpus: int  # CUDA devices; 0 on a CPU host
    available_bytes: int | None  # memory the workers may take; None: unknown (not checked)


def check(nodes: Sequence[NodeCommand], machine: Machine, oversubscribe: bool, origin: str) -> None:
    """Raise a LaunchError when this machine's workers exceed its cores (a CPU host, unless
    `oversubscribe`) or certainly cannot fit its memory; `origin` names what asked for the workers."""
    here = [node for node in nodes if is_local(node.host) and not node.step_nodes]
    if not here:
        return
    workers = sum(node.nproc for node in here)
    if machine.gpus == 0 and workers > machine.cores and not oversubscribe:
        raise LaunchError(
            f"{origin} starts {workers} workers on this machine, which has {machine.cores} CPU "
            f"core{'s' if machine.cores != 1 else ''} and no GPU: more workers than cores take turns on them "
            f"(every step waits for the slowest) and each holds its own copy of torch. Ask for at most "
            f"{machine.cores} (nproc_per_node, or --num-gpus), or set launch.oversubscribe: true "
            f"(--set launch.oversubscribe=true) if it is meant, e.g. to test {workers} ranks here.")
    floor = workers * WORKER_FLOOR_BYTES + len(here) * NODE_FLOOR_BYTES
    if machine.available_bytes is not None and floor > machine.available_bytes:
        raise LaunchError(
            f"{origin} starts {workers} workers on this machine; before the script allocates anything they "
            f"need at least {floor / 2**30:.1f} GiB ({WORKER_FLOOR_BYTES // MIB} MiB each for torch and "
            f"zerorun, {NODE_FLOOR_BYTES // MIB} MiB for torchrun), and {machine.available_bytes / 2**30:.1f} "
            f"GiB is available: nothing was started. Ask for fewer workers, or free memory.")


def this_machine(gpus: int) -> Machine:
    """The launching machine's usable cores and available memory."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return Machine(cores=cores, gpus=gpus, available_bytes=available_memory())


def available_memory(cgroup_root: str = "/sys/fs/cgroup", cgroup_file: str = "/proc/self/cgroup") -> int | None:
    """Bytes a new process may still take: MemAvailable, or less under a cgroup v2 memory limit."""
    import psutil

    available: int | None = int(psutil.virtual_memory().available)
    try:
        with open(cgroup_file) as file:
            path = next((line.split(":", 2)[2].strip() for line in file if line.startswith("0::")), None)
        if path is not None:
            directory = os.path.join(cgroup_root, path.lstrip("/"))
            with open(os.path.join(directory, "memory.max")) as file:
                limit = file.read().strip()
            with open(os.path.join(directory, "memory.current")) as file:
                used = int(file.read().strip())
            if limit != "max":
                room = max(0, int(limit) - used)
                available = room if available is None else min(available, room)
    except (OSError, ValueError, IndexError):
        pass  # no cgroup v2 limit to read: MemAvailable stands
    return available
