"""`zerorun bench io`: GB/s of zerorun's asynchronous O_DIRECT I/O next to dd (and fio) in the same run.

Every case moves the same bytes through the same preallocated file on the disk under test: a
sequential write over the whole file, then a sequential read of it, with O_DIRECT throughout (no
page cache). Ours submits the file as requests over one aligned buffer and waits for them all, with
the block size, queue depth, backend and threads of `zero.aio`; the baselines are `dd` with 8 MiB
blocks (`oflag=direct` / `iflag=direct`) and, where installed, `fio` (libaio, 8 MiB, queue depth 1 and
32). Disks and their host caches drift from run to run (reads here jump between two levels), so the
cases run in interleaved rounds, each round in its own shuffled order (a long run of writes fills
the host's caches, so a fixed order would favour whoever runs first), the page cache is dropped
before each read where allowed, and each row reports its median; the ratio is to the best
baseline's median.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from zerorun.errors import ZerorunError

MiB = 2**20
BASELINE_BLOCK = 8 * MiB
OPS = ("write", "read")
BACKENDS = ("libaio", "threads", "python")
GOAL = 0.9  # ours should reach 90% of the best sequential baseline


@dataclass(frozen=True)
class IoCase:
    tool: str  # "zerorun", "dd" or "fio"
    backend: str  # zerorun: libaio / threads / python; fio: its ioengine; dd: "sync"
    block_size: int
    queue_depth: int
    threads: int = 1

    @property
    def baseline(self) -> bool:
        return self.tool != "zerorun"

    @property
    def label(self) -> str:
        return f"{self.tool} {self.backend}"


@dataclass
class IoResult:
    case: IoCase
    gb_s: dict[str, list[float]] = field(default_factory=lambda: {op: [] for op in OPS})

    def median(self, op: str) -> float | None:
        return statistics.median(self.gb_s[op]) if self.gb_s[op] else None


@dataclass
class IoBench:
    path: str
    filesystem: str
    size: int
    rounds: int
    default_backend: str  # what `backend: auto` picks here
    caches_dropped: bool
    results: list[IoResult]

    def best(self, op: str, baseline: bool) -> IoResult | None:
        rows = [r for r in self.results if r.case.baseline == baseline and r.median(op) is not None]
        return max(rows, key=lambda r: r.median(op), default=None)


def parse_bytes(text: str) -> int:
    """'1M' -> 1048576, '8M', '512K', '4096' (block sizes are powers of two: K/M/G = 2^10/20/30)."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    value = int(float(text[:-1] if text[-1:] in "KMG" else text) * scale)
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def cases(block_sizes: list[int], queue_depths: list[int], threads: list[int], backends: list[str],
          fio: bool) -> list[IoCase]:
    """Ours for every combination (threads only matter to the thread pools), then the baselines."""
    ours = [IoCase("zerorun", backend, block, depth, n) for backend in backends for block in block_sizes
            for depth in queue_depths for n in (threads if backend != "libaio" else [1])]
    baselines = [IoCase("dd", "sync", BASELINE_BLOCK, 1)]
    if fio:
        baselines += [IoCase("fio", "libaio", BASELINE_BLOCK, depth) for depth in (1, 32)]
    return ours + baselines


def run(path: str, size: int, block_sizes: list[int], queue_depths: list[int], threads: list[int],
        backends: list[str], rounds: int = 3, progress: Callable[[str], None] = lambda line: None) -> IoBench:
    """Each case once per round, writes then reads, in a shuffled order; GB/s per round."""
    from zerorun.runtime.offload.nvme import aligned_empty, check_nvme_path, filesystem_type

    size = -(-size // BASELINE_BLOCK) * BASELINE_BLOCK  # dd moves whole 8 MiB blocks
    if any(b % 4096 for b in block_sizes):
        raise ZerorunError("--block-sizes: each must be a multiple of 4096 (O_DIRECT moves whole blocks).")
    check_nvme_path(path, "--path", need_bytes=size + 64 * MiB)
    if shutil.which("dd") is None:
        raise ZerorunError("bench io: `dd` is not on PATH; it is the baseline (install coreutils).")
    from zerorun import ops

    lib = ops.aio_library()
    if lib is None:
        backends = [b for b in backends if b == "python"]
        progress(f"the aio kernel is unavailable ({ops.status()['aio']}); only the python backend runs")
    default = ops.aio_backend_of(lib) if lib is not None else "python"  # what `auto` picks
    results = [IoResult(c) for c in cases(block_sizes, queue_depths, threads, backends, shutil.which("fio") is not None)]
    target = Path(path) / f"zerorun-bench-io-{os.getpid()}.bin"
    buffer = aligned_empty(min(size, 256 * MiB), torch.uint8)
    buffer.random_(0, 256)
    dropped = False
    try:
        _dd(target, size, "write", create=True)  # lay the file out once: every case then overwrites in place
        for round_index in range(rounds):
            order = random.Random(round_index).sample(results, len(results))
            for op in OPS:
                for result in order:
                    if op == "read":
                        dropped = _drop_caches() or dropped
                    seconds = _time_case(result.case, op, target, size, buffer)
                    result.gb_s[op].append(size / seconds / 1e9)
                    progress(f"round {round_index + 1}/{rounds} {op:5} {result.case.label:16} "
                             f"{_size(result.case.block_size):>7} qd {result.case.queue_depth:>2} "
                             f"threads {result.case.threads}: {result.gb_s[op][-1]:.2f} GB/s")
    finally:
        target.unlink(missing_ok=True)
    return IoBench(path, filesystem_type(Path(path)), size, rounds, default, dropped, results)


def _time_case(case: IoCase, op: str, target: Path, size: int, buffer) -> float:
    if case.tool == "dd":
        return _dd(target, size, op)
    if case.tool == "fio":
        return _fio(target, size, op, case.queue_depth)
    return _ours(case, op, target, size, buffer)


def _ours(case: IoCase, op: str, target: Path, size: int, buffer) -> float:
    """Seconds to move the file with our engine: all requests submitted at once, then waited for."""
    from zerorun.runtime.offload.aio import AioSettings, open_engine

    engine = open_engine(AioSettings(case.block_size, case.queue_depth, case.threads, case.backend))
    fd = os.open(target, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
    try:
        step = buffer.numel()
        started = time.perf_counter()
        handles = [engine.submit(fd, buffer.data_ptr(), min(step, size - offset), offset, op == "write")
                   for offset in range(0, size, step)]
        for handle in handles:
            engine.wait(handle)
        return time.perf_counter() - started
    finally:
        os.close(fd)
        engine.close()


def _dd(target: Path, size: int, op: str, create: bool = False) -> float:
    """dd's own figure for moving the file in 8 MiB O_DIRECT blocks (seconds)."""
    count = f"count={size // BASELINE_BLOCK}"
    argv = (["dd", "if=/dev/zero", f"of={target}", "bs=8M", count, "oflag=direct"] + ([] if create else ["conv=notrunc"])
            if op == "write" else ["dd", f"if={target}", "of=/dev/null", "bs=8M", count, "iflag=direct"])
    done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    found = re.search(r"(\d+) bytes .* copied, ([\d.e+-]+) s", done.stderr)
    if done.returncode != 0 or found is None:
        raise ZerorunError(f"bench io: `{' '.join(argv)}` failed: {done.stderr.strip()[-300:]}")
    return float(found.group(2))


def _fio(target: Path, size: int, op: str, depth: int) -> float:
    """fio's own figure for a sequential pass over the file, libaio, 8 MiB blocks, `depth` in flight (seconds)."""
    argv = ["fio", "--name=zerorun", f"--filename={target}", f"--rw={op}", "--bs=8M", f"--size={size}",
            "--ioengine=libaio", f"--iodepth={depth}", "--direct=1", "--output-format=json"]
    done = subprocess.run(argv, capture_output=True, text=True)
    try:
        job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0][op]
        return job["io_bytes"] / job["bw_bytes"]
    except (ValueError, KeyError, IndexError, ZeroDivisionError):
        raise ZerorunError(f"bench io: `{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()[-300:]}") \
            from None


def _drop_caches() -> bool:
    """Drop the page cache (root only); whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return True
    except OSError:
        return False


def render(bench: IoBench) -> Any:
    from rich.table import Table

    best = {op: bench.best(op, baseline=True) for op in OPS}
    table = Table(title=f"Sequential O_DIRECT I/O over a {bench.size // MiB} MiB file in {bench.path} "
                        f"({bench.filesystem}), median GB/s of {bench.rounds} interleaved rounds")
    for column in ("tool", "backend", "block", "queue depth", "threads", "write GB/s", "x best write baseline",
                   "read GB/s", "x best read baseline"):
        table.add_column(column, justify="left" if column in ("tool", "backend") else "right")
    for r in bench.results:
        cells = []
        for op in OPS:
            median, reference = r.median(op), best[op].median(op) if best[op] else None
            cells += [f"{median:.2f}" if median else "-",
                      f"{median / reference:.2f}" if median and reference else "-"]
        threads = str(r.case.threads) if r.case.backend in ("threads", "python") else "-"
        table.add_row(r.case.tool, r.case.backend, _size(r.case.block_size), str(r.case.queue_depth),
                      threads, *cells[:2], *cells[2:], style="dim" if r.case.baseline else None)
    notes = [f"auto backend here: {bench.default_backend}",
             "page cache dropped before reads" if bench.caches_dropped else "page cache not dropped (not root)"]
    table.caption = "\n".join([", ".join(notes), *(_verdict(bench, op) for op in OPS), _recipe_default(bench)])
    return table


def _verdict(bench: IoBench, op: str) -> str:
    ours, baseline = bench.best(op, baseline=False), bench.best(op, baseline=True)
    if ours is None or baseline is None:
        return f"{op}: nothing to compare"
    ratio = ours.median(op) / baseline.median(op)
    mark = "meets" if ratio >= GOAL else "misses"
    return (f"{op}: best ours {ours.median(op):.2f} GB/s ({ours.case.backend}, {_size(ours.case.block_size)} x "
            f"qd {ours.case.queue_depth}) = {ratio:.2f}x best baseline {baseline.median(op):.2f} GB/s "
            f"({baseline.case.label} qd {baseline.case.queue_depth}): {mark} the {GOAL:.0%} goal")


def _recipe_default(bench: IoBench) -> str:
    """The row a recipe gets without zero.aio settings, against the best baseline (no pick among our rows)."""
    from zerorun.config import AioConfig

    default = AioConfig()
    backend = bench.default_backend if default.backend == "auto" else default.backend
    for r in bench.results:
        c = r.case
        if (c.tool, c.backend, c.block_size, c.queue_depth) == ("zerorun", backend, default.block_size,
                                                                 default.queue_depth) \
                and (backend == "libaio" or c.threads == default.threads):
            ratios = [f"{op} {r.median(op) / bench.best(op, True).median(op):.2f}x" for op in OPS
                      if r.median(op) and bench.best(op, True)]
            return f"recipe default (zero.aio: {backend}, {_size(c.block_size)}, qd {c.queue_depth}): {', '.join(ratios)}"
    return "recipe default (zero.aio) not among the cases run"


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes % MiB == 0 else f"{nbytes // 1024} KiB"


def as_json(bench: IoBench) -> dict[str, Any]:
    return {"path": bench.path, "filesystem": bench.filesystem, "size": bench.size, "rounds": bench.rounds,
            "default_backend": bench.default_backend, "caches_dropped": bench.caches_dropped,
            "results": [{"tool": r.case.tool, "backend": r.case.backend, "block_size": r.case.block_size,
                         "queue_depth": r.case.queue_depth, "threads": r.case.threads,
                         **{f"{op}_gb_s": r.gb_s[op] for op in OPS}} for r in bench.results]}
