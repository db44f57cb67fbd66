"""Checkpoints that do not stop training: a snapshot, a background writer, one cross-rank commit.

`checkpoint.py` keeps the format and the synchronous save; this module decides how a save runs.
An asynchronous save (`checkpoint.async_save`, the default), on every rank:

1. On the training thread, the stall: wait for the previous save (at most one is in flight, so
   snapshots never pile up); rank 0 prepares the temporary directory (`checkpoint.begin`); the
   ranks gather their RNG states; the manifest's description, the buffers and the client state are
   copied as they are now. Then training continues.
2. Capture, on the writer thread: this rank's master weights and optimizer state are copied from
   their home (and the owner way's state, from its owner) into a `HostSnapshot` kept between saves (pinned, copied on a side stream, on CUDA).
   An NVMe home is not copied to the host: its files are streamed into the rank file through one
   bounded buffer (`StreamedState`). The next thing that changes that state (the optimizer step, a
   load, `gathered(modify=True)`) first waits for the capture (`before_update`); forward and
   backward run meanwhile.
3. Write and commit, on the writer thread: the rank file (`safetensors_writer`: the bytes the
   synchronous save writes, fsynced), then a marker `.rank-<r>.done` holding its size and CRC32, or
   the error. Rank 0 waits for every rank's marker, then `checkpoint.commit` writes the manifest,
   renames the directory into place and replaces `latest`. The markers live in the checkpoint
   directory, which every node must share already: the commit needs no collective, and the writer
   thread never touches the process group (collectives issued from two threads would interleave
   in different orders on different ranks).

A thread, not a process: the writer spends its time in `os.write` (O_DIRECT), `fsync`, the CRC32
and tensor copies, which release the GIL, and a thread reads the snapshot without a second copy
(`zerorun bench ckpt` measures the stall it leaves).

Failures lose nothing: until the commit, `latest` names the previous checkpoint. A failed write
(a full disk) is raised on the training thread at the next step as an error naming the rank, the
file and the errno, which ends the job (and a `launch.max_restarts` recovery resumes from `latest`);
a killed rank leaves `.tmp-<tag>`, which rank 0 removes at the next save or start.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, cast

import psutil
import torch

from zerorun.errors import ZerorunError
from zerorun.runtime import events
from zerorun.runtime.checkpoint import full_optimizer
from zerorun.runtime.checkpoint import sharded as checkpoint
from zerorun.runtime.checkpoint.files import clean_crashed_saves, shard_file, write_atomic, write_tensors
from zerorun.runtime.checkpoint.snapshot import HostSnapshot, RankState, StreamedState
from zerorun.runtime.context import Runtime
from zerorun.runtime.memory import MemoryReport

log = logging.getLogger("zerorun")

SLOW_ENV = "ZERORUN_CHECKPOINT_SLOW_WRITE_S"  # tests only: seconds the writer sleeps per written chunk
WRITER_NICE = 0  # the writer thread's niceness (0: as the training thread; see `_lower_priority`)
HOST_HEADROOM = 0.8  # a snapshot may take at most this share of the host memory available at the first save


class SavesInFlight:
    """A runtime's checkpointers (runtime/context.py) whose last save no `wait()` has seen yet, in the order of their
    saves: the same on every rank (every rank saves and waits at the same points), so `wait_all`'s collectives match
    across ranks."""

    def __init__(self) -> None:
        self._checkpointers: list[Checkpointer] = []

    def saving(self, checkpointer: Checkpointer) -> None:
        if checkpointer not in self._checkpointers:
            self._checkpointers.append(checkpointer)

    def seen(self, checkpointer: Checkpointer) -> None:
        if checkpointer in self._checkpointers:
            self._checkpointers.remove(checkpointer)

    def wait_all(self, but: Checkpointer | None = None) -> None:
        """Wait for every save in flight but `but`'s; raise the first error."""
        for checkpointer in list(self._checkpointers):
            if checkpointer is not but:
                checkpointer.wait()


class SaveState(Enum):
    CAPTURING = "capturing"  # the writer copies (or streams) the rank's state: the next update waits
    WRITING = "writing"  # the state may change; the files are being written and committed
    DONE = "done"  # committed (rank 0) or this rank's part durable and reported (others)
    FAILED = "failed"


@dataclass
class Save:
    """One save in flight on this rank."""

    tag: str
    step: int
    root: Path
    tmp: Path
    started: float
    stall_s: float = 0.0
    waited_s: float = 0.0
    write_s: float = 0.0
    bytes: int = 0
    state: SaveState = SaveState.CAPTURING
    error: str | None = None
    file: Path | None = None  # the file being written (named in an error)

    def __post_init__(self) -> None:
        self.captured, self.finished = threading.Event(), threading.Event()


class Checkpointer:
    """The engine's saves: synchronous or in the background, at most one in flight, on a cadence."""

    def __init__(self, engine: checkpoint.Engine, runtime: Runtime) -> None:
        """`runtime`: the engine's (its listeners hear of every save; its other saves in flight are waited for)."""
        self.engine, self.cfg = engine, engine.recipe.checkpoint
        self.listeners, self.in_flight = runtime.events, runtime.part(SavesInFlight)
        self.rank, self.shards = engine.comm.rank, engine.store.shard_world
        self.state: RankState | None = None  # built at the first asynchronous save
        self.fallback = False  # the host cannot hold a snapshot: every save is synchronous
        self.current: Save | None = None
        self.last_save = time.monotonic()
        self._reported = True
        self._report_lock = threading.Lock()  # the writer thread and the training thread may both report

    # -- the optimizer's state as torch lays it out (full_optimizer.py) -----------------------------
    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer.state_dict()` under the engine: the whole state, gathered on every rank (a collective)."""
        return full_optimizer.state_dict(cast(full_optimizer.Engine, self.engine), optimizer)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
        """`optimizer.load_state_dict(sd)` under the engine (every rank, with the same `sd`)."""
        full_optimizer.load_state_dict(cast(full_optimizer.Engine, self.engine), optimizer, state_dict)

    # -- cadence ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Whether the recipe asks for a save after optimizer step `step` (every rank agrees)."""
        if self.cfg.dir is None:
            return False
        due = bool(self.cfg.every_steps) and step % self.cfg.every_steps == 0
        if self.cfg.every_minutes:  # clocks differ per rank: agree by one all-reduce of a flag
            late = time.monotonic() - self.last_save >= self.cfg.every_minutes * 60
            flag = torch.tensor([float(due or late)], device=self.engine.device)
            self.engine.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=False).wait()
            due = bool(flag.item())
        return due

    # -- saving -------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike, tag: str, client_state: dict | None, block: bool = False) -> Path:
        """Save the engine as `directory/tag`; without `block`, return once the state is snapshotted."""
        started = time.perf_counter()
        waited = self._wait_previous(tag)
        self.last_save = time.monotonic()
        if not self.cfg.async_save or self._host_too_small():
            path = checkpoint.save(self.engine, directory, tag, client_state)
            stall = time.perf_counter() - started
            mode = "sync-fallback" if self.fallback else "sync"
            self._emit(events.CheckpointStats(tag, self.engine.global_step, mode, stall, waited, 0.0,
                                              self._rank_bytes(path), 0))
            return path
        assert self.state is not None  # built by _host_too_small() for a save that goes to the background
        root, tmp = checkpoint.begin(self.engine, directory, tag)
        rng = checkpoint.gather_rng(self.engine)
        save = Save(tag, self.engine.global_step, root, tmp, started, waited_s=waited)
        manifest = checkpoint.describe(self.engine, tag, rng, checkpoint.describe_optimizer(self.engine))
        job = _Job(self, save, manifest, checkpoint.extras_of(self.engine.model, copy=True),
                   checkpoint.client_payload(client_state), self.state.ready_event())
        self.current, self._reported = save, False
        self.in_flight.saving(self)
        # before the writer starts: it reports the save the moment it commits, which a small save on a loaded
        # machine did before this thread ran its next line (CI: a record of stall 0.0 s after a wait of 0.90 s)
        save.stall_s = time.perf_counter() - started
        threading.Thread(target=job.run, name=f"zerorun-checkpoint-{tag}", daemon=False).start()
        if block:
            self.wait()
        return root / tag

    def before_update(self) -> None:
        """Wait until the save in flight has captured this rank's state (call before changing it)."""
        save = self.current
        if save is not None and not save.captured.is_set():
            started = time.perf_counter()
            save.captured.wait()
            save.stall_s += time.perf_counter() - started

    def poll(self) -> None:
        """After a step: report a finished save, or raise its error (the training thread learns of it here)."""
        save = self.current
        if save is not None and save.finished.is_set():
            self._finish(save)

    def wait(self) -> None:
        """Wait until the save in flight is committed; raise its error on every rank. A collective: every
        rank calls it (only rank 0 knows when the commit is done)."""
        save = self.current
        if save is not None:
            save.finished.wait()
        failed = torch.tensor([float(save is not None and save.error is not None)], device=self.engine.device)
        if self.engine.comm.world_size > 1:
            self.engine.comm.all_reduce(failed, op=torch.distributed.ReduceOp.MAX, async_op=False).wait()
        self.in_flight.seen(self)
        if save is not None:
            self._finish(save)
        if failed.item():
            raise ZerorunError(f"checkpoint {save.tag if save else ''} not saved: another rank's write failed (its "
                               "error says where); `latest` names the previous checkpoint.")

    def _wait_previous(self, tag: str) -> float:
        save, started = self.current, time.perf_counter()
        busy = save is not None and not save.finished.is_set()  # rank 0 finishes last: it commits
        self.wait()
        waited = time.perf_counter() - started
        if busy and save is not None and self.rank == 0:
            log.warning("zerorun: checkpoint %s waited %.2f s for %s to finish writing (at most one save is in "
                        "flight; save less often or on faster storage)", tag, waited, save.tag)
        return waited

    def _finish(self, save: Save) -> None:
        self.report(save)
        if save.error is not None:
            error, save.error = save.error, None
            raise ZerorunError(error)

    def report(self, save: Save) -> None:
        """Tell the listeners (telemetry) of a save that committed, once: from the writer thread the moment it
        is done, or from the training thread if that sees it first. Not at the next step's `poll()` only: a
        Ctrl-C in the step after a commit (SIGTERM to the workers) lost the record, and the job's summary said
        "1 saved; step-3" with step-6 on disk."""
        with self._report_lock:
            if self._reported:
                return
            self._reported = True
        if save.error is None:
            self._emit(events.CheckpointStats(save.tag, save.step, "async", save.stall_s, save.waited_s,
                                              save.write_s, save.bytes, self.snapshot_bytes()))

    def _emit(self, stats: events.CheckpointStats) -> None:
        self.listeners.emit_checkpoint(stats)

    # -- memory -------------------------------------------------------------------------------------
    def _host_too_small(self) -> bool:
        """At the first asynchronous save: build the snapshot, or fall back to synchronous saves (every
        rank agrees; one warning naming the numbers) when the host cannot hold it."""
        if self.state is not None or self.fallback:
            return self.fallback
        home, numels = self.engine.store.home, list(self.engine.store.group_numels)
        writes = self.rank < self.shards
        resident = home.resident  # where the state sits in memory; None: in files, streamed at each save
        snapshot = HostSnapshot if resident is not None else StreamedState
        need = snapshot.bytes_for(numels, [home.kinds(g) for g in range(len(numels))]) if writes else 0
        available = psutil.virtual_memory().available
        flag = torch.tensor([float(need > HOST_HEADROOM * available)], device=self.engine.device)
        self.engine.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, async_op=False).wait()
        if flag.item():
            self.fallback = True
            if need > HOST_HEADROOM * available:
                log.warning("zerorun: rank %d: a checkpoint snapshot needs %.2f GiB of host memory and %.2f GiB are "
                            "available (at most %d%% may go to it): checkpoints are saved synchronously",
                            self.rank, need / 2**30, available / 2**30, HOST_HEADROOM * 100)
            return True
        if not writes:
            self.state = RankState()
        elif resident is not None:
            self.state = HostSnapshot(home, numels, resident, self.engine.update.owned_tensors)
        else:
            self.state = StreamedState(home, numels, self.engine.update.owned_tensors)
        return False

    def snapshot_bytes(self) -> int:
        return self.state.nbytes if self.state is not None else 0

    def account(self, report: MemoryReport) -> None:
        """The snapshot's host bytes, as the kind `snapshot` (kept between saves)."""
        if self.snapshot_bytes():
            report.add("snapshot", "cpu", self.snapshot_bytes())

    def _rank_bytes(self, path: Path) -> int:
        file = path / shard_file(self.rank)
        return file.stat().st_size if self.rank < self.shards and file.is_file() else 0

    def clean_start(self) -> None:
        """Rank 0 at startup: remove what a save that never committed left behind (after this process's
        own saves in flight, from an engine made before this one, have finished)."""
        self.in_flight.wait_all(but=self)
        if self.rank == 0 and self.cfg.dir is not None and Path(self.cfg.dir).is_dir():
            clean_crashed_saves(Path(self.cfg.dir))


class _Job:
    """The writer thread's work for one save (see the module docstring, steps 2 and 3)."""

    def __init__(self, owner: Checkpointer, save: Save, manifest: dict, extras: dict, client: dict | bytes | None,
                 ready: object) -> None:
        self.owner, self.save, self.manifest, self.extras, self.client, self.ready = \
            owner, save, manifest, extras, client, ready
        assert owner.state is not None  # a background save has its snapshot
        self.rank, self.shards, self.state = owner.rank, owner.shards, owner.state
        self.timeout_s = owner.engine.recipe.launch.timeout_s
        slow = float(os.environ.get(SLOW_ENV, "0") or 0)
        self.pace = (lambda: time.sleep(slow)) if slow > 0 else None

    def run(self) -> None:
        save, started = self.save, time.perf_counter()
        _lower_priority(WRITER_NICE)
        try:
            if self.rank < self.shards:
                self._write_shard()
            save.captured.set()
            save.state = SaveState.WRITING
            if self.rank == 0:
                files = self._wait_for_ranks()
                save.file = save.tmp
                checkpoint.commit(save.root, save.tmp, self.manifest, files, self.extras, self.client,
                                  self.owner.cfg.keep_last)
            save.state = SaveState.DONE
        except BaseException as exc:  # noqa: BLE001 - every failure reaches the training thread
            save.error = _describe_failure(self.rank, save, exc)
            save.state = SaveState.FAILED
            self._mark({"error": save.error})
        finally:
            save.write_s = time.perf_counter() - started
            save.captured.set()
            save.finished.set()
        self.owner.report(save)

    def _write_shard(self) -> None:
        save, state = self.save, self.state
        state.capture(self.ready)
        if not state.streams:
            save.captured.set()  # the snapshot holds the state: the next update may change the live one
        save.file = save.tmp / shard_file(self.rank)
        size, crc = write_tensors(save.file, state.sources(), self.pace)
        save.captured.set()
        save.bytes = size
        checkpoint.crash_point("shard", self.rank, save.tag)
        self._mark({"bytes": size, "crc32": crc})

    def _mark(self, entry: dict) -> None:
        """This rank's part is done (or failed): a marker rank 0 reads. Best effort after a failure."""
        if self.rank >= self.shards:
            return
        try:
            write_atomic(_marker(self.save.tmp, self.rank), json.dumps(entry).encode())
        except OSError:
            if "error" not in entry:
                raise

    def _wait_for_ranks(self) -> dict[str, dict[str, int]]:
        """Rank 0: every writing rank's size and CRC32, once all are durable; a rank's error is raised."""
        files: dict[str, dict[str, int]] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(files) < self.shards:
            for r in range(self.shards):
                marker = _marker(self.save.tmp, r)
                if shard_file(r) in files or not marker.is_file():
                    continue
                entry = json.loads(marker.read_text())
                if "error" in entry:
                    raise _RankFailed(entry["error"])
                files[shard_file(r)] = {"bytes": int(entry["bytes"]), "crc32": int(entry["crc32"])}
                marker.unlink()
            if len(files) < self.shards:
                if time.monotonic() > deadline:
                    missing = [r for r in range(self.shards) if shard_file(r) not in files]
                    raise ZerorunError(f"checkpoint {self.save.tag}: ranks {missing} did not finish writing their "
                                       f"files in {self.save.tmp} within launch.timeout_s ({self.timeout_s:g} s).")
                time.sleep(0.02)
        return files


def _lower_priority(nice: int) -> None:
    """Give the writer thread (only it: Linux keeps a niceness per thread) `nice` more niceness than
    the training thread, so the scheduler prefers the ranks' compute when the cores are all busy."""
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), os.getpriority(os.PRIO_PROCESS, 0) + nice)
        except OSError:
            pass  # a niceness is advice: a save goes on without it


class _RankFailed(Exception):
    """Another rank's write failed; its message says where."""


def _marker(tmp: Path, rank: int) -> Path:
    return tmp / f".rank-{rank:05d}.done"


def _describe_failure(rank: int, save: Save, exc: BaseException) -> str:
    if isinstance(exc, _RankFailed):
        return f"checkpoint {save.tag} not saved: {exc}"
    where = f"rank {rank}: checkpoint {save.tag} not saved (the previous checkpoint stays `latest`): writing " \
            f"{save.file or save.tmp} failed"
    if isinstance(exc, OSError):
        return f"{where}: {checkpoint.os_error(exc)}."
    if isinstance(exc, ZerorunError):  # a full disk, already named with its errno and what is kept
        return f"{where}: {exc}"
    return f"{where}: {type(exc).__name__}: {exc}"


def wait_all(runtime: Runtime) -> None:
    """Wait for every save in flight of `runtime`'s engines (the worker calls this when the script ends, a load
    before it reads); raise the first error."""
    runtime.part(SavesInFlight).wait_all()
