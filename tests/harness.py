"""Multi-rank tests: run a function on N gloo ranks, as threads of this process or as processes.

    results = run_threads(train_and_report, 3, (config,))   # tests/rank_threads.py: 0.05 s a call
    results = run_ranks(train_and_report, 3, (config,))     # rank processes: 0.45 s a call

A failure on any rank fails the test with that rank's traceback; a hang fails it after `timeout`.
Threads are the default for the runtime's tests: each rank a gloo rank of its own on the same wire, the same
collective algorithms as processes. A test takes processes where a process is what it tests, or where its ranks
would share something a thread cannot have alone (tests/rank_threads.py lists what). The runtime's files that stay
on processes, and why:
- compute-bound training (threads gain little on a loaded machine and take turns under the GIL on a quiet one):
  test_engine_parity, test_offload, test_hier_collectives, test_overlap_optimizer, test_reduce_dtype;
- what they test is per process: test_interop (what zerorun changes in torch), test_sharded_init
  (nn.Module.register_parameter replaced), test_compile (dynamo, not thread safe, and its counters),
  test_cuda_standin (torch.cuda and torch.distributed stood in for), test_host_allocator and test_block_cache
  (glibc's heap), test_architecture (the files a process enters), test_publish_overlap (the worker's
  destroy_process_group, the engines' settle);
- they change the process for their ranks: test_compression (the link's measurement, the zerorun logger),
  test_stage3_plan (caught warnings), test_desync (a fresh shared-memory segment per case);
- saves in flight are kept per process (checkpoint/background.py): test_checkpoint*, test_resume_check.
Single cases elsewhere say why where they stay on processes.

Each rank is a new process forked from a server that imported, once for the whole session, what every rank
imports (`forkserver` with `PRELOAD`), rather than a fresh interpreter importing it again: torch itself, and
torch._dynamo, which torch imports lazily when the first optimizer is built (its import, sympy included, was
most of the seconds each multi-rank call cost: `python -m tests.harness`), and zerorun's runtime. Importing
runs no code of a test and starts no thread (no thread pool exists to be forked); the last import freezes what
the others imported out of the garbage collector's reach (`tests/frozen_imports.py`); a module's state is as
import leaves it, so every rank starts from the same fresh state, sets torchrun's variables and joins its own
process group, and a test proves what it proved.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any, Callable

import pytest

from tests.rank_threads import run_threads as _run_threads
from tests.rank_threads import seeded  # noqa: F401 - the rank functions' seed, for either harness
from zerorun.bench.spawn import RankFailure
from zerorun.bench.spawn import run_ranks as _run_ranks

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.optim", "zerorun", "zerorun.runtime.engine",
           "tests.runtime.reference", "tests.frozen_imports"]
_context: Any = None


def _forkserver() -> Any:
    """The session's forkserver context, `PRELOAD` imported in its server (started at the first call)."""
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """`fn` on `world_size` rank processes: where a process is what is tested, or what the ranks share
    (tests/rank_threads.py says what threads share)."""
    try:
        return _run_ranks(fn, world_size, args, timeout, context=_forkserver())
    except RankFailure as exc:
        pytest.fail(str(exc), pytrace=False)


def run_threads(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 240.0) -> list[Any]:
    """`fn` on `world_size` rank threads of this process, each a gloo rank of its own (tests/rank_threads.py)."""
    try:
        return _run_threads(fn, world_size, args, timeout)
    except RankFailure as exc:
        pytest.fail(str(exc), pytrace=False)


class Concurrency:
    """How many calls of a fake (standing in for ssh, a node) ran at once: `with counter: ...` in the fake."""

    def __init__(self) -> None:
        import threading

        self._lock = threading.Lock()
        self.running = 0
        self.most = 0

    def __enter__(self) -> Concurrency:
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
        return self

    def __exit__(self, *exc: object) -> None:
        import time

        time.sleep(0.01)  # long enough for the others to pile up if nothing bounds them
        with self._lock:
            self.running -= 1


def _join(rank: int, world: int) -> int:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():  # a rank thread's group exists already
        dist.init_process_group("gloo")
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # what every engine does: torch imports dynamo here
    dist.barrier()
    return rank


if __name__ == "__main__":
    # python -m tests.harness: seconds per 2-rank call that joins the process group and builds an optimizer, spawned
    # ranks, the forkserver's and rank threads, interleaved (the start-up cost each multi-rank test pays)
    import functools
    import time

    contexts = {"spawn": mp.get_context("spawn"), "forkserver": _forkserver()}
    calls: dict[str, Callable[[], object]] = {name: functools.partial(_run_ranks, _join, 2, context=context)
                                              for name, context in contexts.items()}
    calls["threads"] = functools.partial(_run_threads, _join, 2)
    calls["forkserver"]()  # starts the server, once per session
    seconds: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(4):
        for name, call in calls.items():
            started = time.perf_counter()
            call()
            seconds[name].append(time.perf_counter() - started)
    for name, values in seconds.items():
        print(f"{name}: median {sorted(values)[len(values) // 2]:.2f} s ({', '.join(f'{v:.2f}' for v in values)})")
