"""Profiler traces on request, from every rank: `telemetry.profile_start` and `telemetry.profile_steps`.

    telemetry: {profile_start: 5, profile_steps: 2}   # optimizer steps 5 and 6, counted from 0 like the logs

Every rank records `torch.profiler` over those steps (CPU activity, and CUDA's where the rank has a
GPU) with zerorun's phases as named ranges (`zerorun.forward`, `zerorun.reduce-scatter`, ...:
runtime/ranges.py), then writes, in the directory the launcher runs in,

    runs/<name>/profile/<job id>/rank-<r>.trace.json.gz   Chrome trace JSON: ui.perfetto.dev, chrome://tracing
    runs/<name>/profile/<job id>/rank-<r>.memory.pickle   CUDA only: the allocator's history over the window
                                                          (`torch.cuda.memory._dump_snapshot`: pytorch.org/memory_viz)

(`<job id>` is `local` outside `zerorun launch`). The window opens when the engine reaches step
`profile_start` (at `initialize` when it starts there, e.g. 0 or a resumed step) and closes after
`profile_steps` more, or when the script ends first (the worker calls `finish`). Steps are counted
through `events.StepStats`, so the window needs nothing from the training loop.

Profiling never fails a run: an error starting, stopping or writing is one warning on that rank, and
training goes on without the profiler. What needs CUDA (its activity, the memory history) sits behind
`MemoryHistory` and the profiler factory, so the window's logic runs, and is tested, on a CPU.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from zerorun.jobs import JOB_ID_ENV
from zerorun.runtime import context
from zerorun.runtime.ranges import Ranges
from zerorun.telemetry.profile_files import MEMORY_SUFFIX, TRACE_SUFFIX, profile_dir

log = logging.getLogger("zerorun")

MEMORY_ENTRIES = 100_000  # allocator events the CUDA history keeps (the newest): a few MB per rank



class Profiler(Protocol):
    """What the window asks of `torch.profiler.profile` (a fake stands in for it in tests)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def export_chrome_trace(self, path: str) -> None: ...


class MemoryHistory(Protocol):
    """The CUDA caching allocator's history: recorded over the window, dumped at its end."""

    def start(self) -> None: ...

    def dump(self, path: Path) -> None: ...

    def stop(self) -> None: ...


class CudaMemoryHistory:
    """`torch.cuda.memory._record_memory_history` and `_dump_snapshot` (underscored, but the documented way:
    pytorch.org/docs/stable/torch_cuda_memory.html)."""

    def start(self) -> None:
        torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)

    def dump(self, path: Path) -> None:
        torch.cuda.memory._dump_snapshot(str(path))

    def stop(self) -> None:
        torch.cuda.memory._record_memory_history(enabled=None)


def torch_profiler(cuda: bool) -> Profiler:
    """torch.profiler over the CPU, and CUDA's kernels and copies where the rank has a GPU."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


class ProfileWindow:
    """Records steps [start, start + steps) on this rank and writes their trace (and memory snapshot)."""

    def __init__(self, start: int, steps: int, directory: Path, rank: int,
                 profiler: Callable[[], Profiler], memory: MemoryHistory | None, ranges: Ranges | None = None) -> None:
        """`ranges`: the engine's runtime's, named in the trace while the window records."""
        self.start, self.stop_at = start, start + steps
        self.ranges = ranges or Ranges()
        self.directory, self.rank = directory, rank
        self._make_profiler, self.memory = profiler, memory
        self._profiler: Profiler | None = None
        self._memory_on = False
        self.failed = False  # one warning said why; nothing more is tried
        self.written: list[Path] = []

    @property
    def recording(self) -> bool:
        return self._profiler is not None

    def reached(self, step: int) -> None:
        """The engine is at optimizer step `step` (0 before the first update): open or close the window."""
        if self.failed:
            return
        if self._profiler is None and self.start <= step < self.stop_at and not self.written:
            self._guarded("start", self._open)
        elif self._profiler is not None and step >= self.stop_at:
            self.close()

    def close(self) -> None:
        """Stop recording and write what was recorded (once; a window that never opened writes nothing)."""
        if self._profiler is not None:
            self._guarded("write", self._write)

    def _open(self) -> None:
        profiler = self._make_profiler()
        if self.memory is not None:
            self.memory.start()
            self._memory_on = True
        profiler.start()
        self._profiler = profiler
        self.ranges.record(True)

    def _write(self) -> None:
        profiler, self._profiler = self._profiler, None
        assert profiler is not None, "a window writes what it recorded"
        self.ranges.record(False)
        try:
            profiler.stop()
        finally:
            if self.memory is not None:
                self._dump_memory()
        self.directory.mkdir(parents=True, exist_ok=True)
        trace = self.directory / f"rank-{self.rank}{TRACE_SUFFIX}"
        profiler.export_chrome_trace(str(trace))
        self.written.insert(0, trace)

    def _dump_memory(self) -> None:
        assert self.memory is not None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / f"rank-{self.rank}{MEMORY_SUFFIX}"
            self.memory.dump(path)
            self.written.append(path)
        finally:
            self._memory_off()

    def _memory_off(self) -> None:
        """The CUDA history costs a little on every allocation: it never outlives the window."""
        if self.memory is not None and self._memory_on:
            self._memory_on = False
            self.memory.stop()

    def _guarded(self, what: str, action: Callable[[], None]) -> None:
        """Run `action`; on any error, one warning, and the window gives up (training goes on)."""
        try:
            action()
        except Exception as exc:  # noqa: BLE001 - profiling never fails a run
            self.failed = True
            self._profiler = None
            self.ranges.record(False)
            try:
                self._memory_off()
            except Exception:  # noqa: BLE001 - the warning below is the one this window gives
                pass
            log.warning("zerorun: rank %d: profile not %s (training goes on without it): %s: %s", self.rank,
                        "started" if what == "start" else f"written to {self.directory}", type(exc).__name__, exc)


def attach(engine: Any, profiler: Callable[[], Profiler] | None = None,
           memory: MemoryHistory | None = None) -> ProfileWindow | None:
    """Open a window for `engine` as its recipe's telemetry asks (None when it asks for none); `zerorun.initialize`
    calls it. `profiler` and `memory` replace torch's (tests); by default CUDA's activity and memory history
    are recorded where the engine's device is a GPU."""
    telemetry = engine.recipe.telemetry
    if telemetry.profile_start is None:
        return None
    open_window = engine.runtime.part(OpenWindow)
    open_window.finish()  # a second engine in the runtime: the first one's window ends here
    cuda = engine.device.type == "cuda"
    job = os.environ.get(JOB_ID_ENV) or "local"
    window = ProfileWindow(telemetry.profile_start, telemetry.profile_steps, profile_dir(engine.recipe.name, job),
                           engine.comm.rank, profiler or (lambda: torch_profiler(cuda)),
                           memory if memory is not None else (CudaMemoryHistory() if cuda else None),
                           engine.runtime.ranges)
    open_window.open(window, engine.runtime.events.subscribe(lambda stats: window.reached(stats.step)))
    window.reached(engine.global_step)
    return window


class OpenWindow:
    """A runtime's window in flight (runtime/context.py): one at a time, as torch.profiler records one at a time."""

    def __init__(self) -> None:
        self.window: ProfileWindow | None = None
        self._unsubscribe: Callable[[], None] | None = None  # its step listener

    def open(self, window: ProfileWindow, unsubscribe: Callable[[], None]) -> None:
        self.window, self._unsubscribe = window, unsubscribe

    def finish(self) -> None:
        window, unsubscribe, self.window, self._unsubscribe = self.window, self._unsubscribe, None, None
        if unsubscribe is not None:
            unsubscribe()
        if window is not None:
            window.close()


def finish(runtime: context.Runtime | None = None) -> None:
    """Close the window in flight, if any (the worker calls this when the script ends; None: this thread's)."""
    (runtime or context.current()).part(OpenWindow).finish()
