"""Multi-process tests: run a function on N gloo ranks (see `zerorun.bench.spawn`).

    results = run_ranks(train_and_report, 3, (config,))

A failure on any rank fails the test with that rank's traceback; a hang is killed after `timeout`.

Each rank is a new process forked from a server that imported, once for the whole session, what every rank
imports (`forkserver` with `PRELOAD`), rather than a fresh interpreter importing it again: torch itself, and
torch._dynamo, which torch imports lazily when the first optimizer is built (its import, sympy included, was
most of the seconds each multi-rank call cost: `python -m tests.harness`), and zerorun's runtime. Importing
runs no code of a test and starts no thread (no thread pool exists to be forked); a module's state is as
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
           "tests.runtime.reference"]
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
