"""Ranks as threads: `fn(rank, world_size, *args)` on N ranks that are threads of the calling process.

    results = run_threads(train_and_compare, 2, (cases,))      # through tests/harness.py

Why: a rank process costs ~0.5 s per call even forked from the preloaded server (`run_ranks`), a rank thread
~0.03 s (`python -m tests.harness` measures the three ways). The runtime's tests make hundreds of such calls.

What stays real. Each thread is a rank of a gloo process group of its own (its own `ProcessGroupGloo`, joined to
the others' over loopback TCP, as processes join), so a rank thread takes the very wire a rank process takes:
wire.py's gloo routes, the pairwise point-to-point collectives, the hierarchy's subgroups (`dist.new_group`) and
the shared-memory segment (a /dev/shm file each rank maps; its meeting is a futex, which a thread waits on as a
process does). torch keeps the default process group and its group registry per process; for thread ranks torch's
own tests (`MultiThreadedTestCase`) make both per thread (`ThreadLocalWorld`, c10d's thread isolation mode). Here
they are per rank (`RankWorlds`): the threads a rank starts are in its world, as a process's threads are in the
process's (the shared-memory, hierarchy and codec workers issue collectives on the rank's groups).

What the threads share, so a test that depends on it stays a process test (`run_ranks`):
- torch's global random generator. `torch.manual_seed` in a rank thread raises unless inside `seeded(seed)`, which
  holds a lock while it seeds and builds: two ranks seeding at once would draw each other's numbers.
- the process: its environment (torchrun's RANK and LOCAL_RANK are not set; WORLD_SIZE and LOCAL_WORLD_SIZE are, the
  same for every rank), signals, exit, pid, the torch attributes engines patch (zerorun/runtime/context.py: each
  rank has a runtime of its own, with its engines, listeners, saves in flight and segments), torch.compile (dynamo
  is not thread safe), glibc's heap tuning.
- no rank can die alone: a failing rank's group is destroyed, which fails its peers' gloo calls at once; a peer
  waiting in shared memory waits out its timeout (a thread is never killed), after this call has reported.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist

from zerorun.bench.spawn import RankFailure

_SEEDING = threading.RLock()  # held by `seeded`: one rank thread at a time seeds and draws from the global generator
_seed = torch.manual_seed


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """`torch.manual_seed(seed)` and what follows inside, as one step no other rank thread's draws interleave with
    (in a rank process: just the seed)."""
    with _SEEDING:
        _seed(seed)
        yield


def _guarded_seed(seed: int) -> Any:
    if not _SEEDING._is_owned():  # type: ignore[attr-defined]
        raise AssertionError("torch.manual_seed in a rank thread: every rank thread draws from one global generator, "
                             "so seed and build inside tests.rank_threads.seeded(seed)")
    return _seed(seed)


class RankWorlds:
    """c10d's world (its default group and group registry) per rank, as torch's `ThreadLocalWorld` keeps it per
    thread, with one difference: a thread a rank starts (its shared-memory, hierarchy and codec workers, which issue
    collectives for it) is in that rank's world, as a process's threads are in the process's. `start_thread`
    stands in for `threading.Thread.start` while rank threads run, to note who started each thread."""

    def __init__(self) -> None:
        from torch.testing._internal.distributed.multi_threaded_pg import WorldData

        self._local = threading.local()
        self._new = lambda: WorldData(None, {}, {}, {}, {}, 0, {}, {}, {}, [])

    def enter_rank(self) -> None:
        self._local.world = self._new()

    def mine(self) -> Any:
        """This thread's rank's world: its own, or its starter's."""
        world = getattr(self._local, "world", None)
        if world is None:
            world = getattr(threading.current_thread(), "_rank_world", None)
        if world is None:
            world = self._local.world = self._new()  # a thread of no rank: a world with no group, as c10d's at start
        return world

    def start_thread(self, start: Callable[[threading.Thread], None]) -> Callable[[threading.Thread], None]:
        def started_by_a_rank(thread: threading.Thread) -> None:
            thread._rank_world = self.mine()  # type: ignore[attr-defined]
            start(thread)
        return started_by_a_rank

    def __getattr__(self, name: str) -> Any:  # the attributes c10d reads of its `_world`
        return getattr(self.mine(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.mine(), name, value)


@contextlib.contextmanager
def _thread_world(world_size: int) -> Iterator[RankWorlds]:
    """While rank threads run: c10d's world and group registry per rank thread, one intra-op thread (as each rank
    process has), the global generator guarded, and the environment every rank shares."""
    import torch.distributed.distributed_c10d as c10d

    saved_world, saved_threads = c10d._world, torch.get_num_threads()
    saved_env = {key: os.environ.get(key) for key in ("WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    worlds = RankWorlds()
    c10d._world = worlds
    start = threading.Thread.start
    threading.Thread.start = worlds.start_thread(start)  # type: ignore[method-assign]
    torch.set_num_threads(1)
    torch.manual_seed = torch.random.manual_seed = _guarded_seed  # type: ignore[assignment]
    try:
        yield worlds
    finally:
        torch.manual_seed = torch.random.manual_seed = _seed  # type: ignore[assignment]
        threading.Thread.start = start  # type: ignore[method-assign]
        torch.set_num_threads(saved_threads)
        c10d._world = saved_world
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _rank(fn: Callable[..., Any], rank: int, world_size: int, args: tuple, worlds: RankWorlds, store: dist.Store,
          timeout: float, outcomes: dict[int, tuple[bool, Any, float]]) -> None:
    from zerorun.runtime import context

    worlds.enter_rank()
    try:  # the rank's own runtime (its engines, listeners, saves and segments), closed when the rank ends
        with torch.autograd.set_multithreading_enabled(False), context.using(context.Runtime()) as runtime:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store,
                                    timeout=datetime.timedelta(seconds=timeout))
            value = fn(rank, world_size, *args)
            runtime.engines.settle_all()  # a group destroyed under a running collective aborts the whole process
            dist.barrier()  # nothing of any rank is still in flight when the groups go
        outcomes[rank] = (True, value, time.monotonic())
    except BaseException:  # noqa: BLE001 - every failure goes back to the caller
        outcomes[rank] = (False, traceback.format_exc(), time.monotonic())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # a failed rank's peers see their connections close, and fail too


def run_threads(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` rank threads; return the results in rank order.

    The first failure raises `RankFailure` with that rank's traceback; a hang raises after `timeout` with where each
    unfinished rank stands."""
    outcomes: dict[int, tuple[bool, Any, float]] = {}
    with _thread_world(world_size) as worlds:
        store = dist.HashStore()
        threads = [threading.Thread(target=_rank, args=(fn, r, world_size, args, worlds, store, timeout, outcomes),
                                    name=f"rank-{r}", daemon=True) for r in range(world_size)]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = [t for t in threads if t.is_alive()]
            failed = [at for ok, _, at in list(outcomes.values()) if not ok]
            if not alive or (failed and time.monotonic() - min(failed) > 5.0):  # its peers had their chance to end
                break
            alive[0].join(0.05)
    failures = sorted((at, r) for r, (ok, _, at) in outcomes.items() if not ok)
    if failures:  # the first to fail: its peers' failures follow from it
        rank = failures[0][1]
        raise RankFailure(f"rank {rank} failed:\n{outcomes[rank][1]}")
    if len(outcomes) < world_size:
        raise RankFailure(f"timed out after {timeout:.0f}s; ranks that finished: {sorted(outcomes)}\n"
                          + _where(t for t in threads if t.is_alive()))
    return [outcomes[r][1] for r in range(world_size)]


def _where(threads: Iterator[threading.Thread]) -> str:
    """Each thread's stack, innermost last (what a hung rank was doing)."""
    frames = sys._current_frames()
    return "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}"
                     for t in threads if t.ident in frames)
