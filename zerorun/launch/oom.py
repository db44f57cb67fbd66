"""Was a process killed by the kernel's out-of-memory killer? The relay asks when its worker died of SIGKILL.

A SIGKILL alone says nothing: the OOM killer, a user's `kill -9` and a scheduler's hard limit all
send it. Two witnesses can tell, where this process may read them:
- the memory cgroup's OOM-kill counter, read before the worker starts and after it died (cgroup
  v2: `oom_kill` in `memory.events`, which counts the cgroup's descendants too; v1: `oom_kill` in
  `memory.oom_control`, this cgroup only);
- the kernel log (`/dev/kmsg`, readable by root or with CAP_SYSLOG): the OOM killer writes
  "Killed process <pid> (...)" for every process it kills, in any cgroup.
Standard library only: the relay runs before the worker imports anything heavy.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
KERNEL_LOG = "/dev/kmsg"
_MAX_LOG_RECORDS = 100_000  # the kernel's ring buffer holds far fewer: a bound, not a limit


def oom_kills(root: Path = CGROUP_ROOT, cgroup_file: str = "/proc/self/cgroup") -> int | None:
    """OOM kills counted so far in this process's memory cgroup; None where no counter can be read."""
    try:
        with open(cgroup_file) as file:
            lines = file.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":  # v2: the unified hierarchy
            candidates += [root / path.lstrip("/") / "memory.events", root / "memory.events"]
        elif "memory" in controllers.split(","):
            candidates += [root / "memory" / path.lstrip("/") / "memory.oom_control",
                           root / "memory" / "memory.oom_control"]
    for candidate in candidates:
        count = _counter(candidate, "oom_kill")
        if count is not None:
            return count
    return None


def killed_by_oom(pid: int, kills_before: int | None, started: float, log: str = KERNEL_LOG) -> bool:
    """Whether `pid`, just found dead of SIGKILL, was the OOM killer's: the kernel log names it after
    `started` (its `time.monotonic()` at start: an older line is about an earlier process of that pid),
    or the cgroup's OOM-kill counter went up since `kills_before`."""
    if _kernel_log_names(pid, started, log):
        return True
    after = oom_kills()
    return kills_before is not None and after is not None and after > kills_before


def _counter(path: Path, key: str) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    match = re.search(rf"^{key} (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def _kernel_log_names(pid: int, started: float, log: str) -> bool:
    """Whether the kernel log holds the OOM killer's "Killed process <pid> (" line, stamped after `started`
    (a record is "prio,seq,microseconds since boot,flags;message", on the monotonic clock)."""
    needle = f"Killed process {pid} (".encode()
    try:
        fd = os.open(log, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        for _ in range(_MAX_LOG_RECORDS):
            try:
                record = os.read(fd, 8192)  # /dev/kmsg: one record per read
            except BlockingIOError:
                return False
            except OSError:  # EPIPE: records overwritten while reading; read on
                continue
            if not record:
                return False
            header, _, message = record.partition(b";")
            fields = header.split(b",")
            stamp = int(fields[2]) / 1e6 if len(fields) > 2 and fields[2].isdigit() else started
            if needle in message and stamp >= started - 1.0:
                return True
        return False
    finally:
        os.close(fd)
