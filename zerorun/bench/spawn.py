"""Run a function on N local ranks of a gloo process group and collect each rank's result.

Used by the benchmarks and by the multi-process tests (`tests/harness.py`): each rank is a fresh
spawned process with torchrun's variables set and `threads` CPU threads, so
`zerorun.runtime.comm.dist.init_distributed` and the engine behave exactly as under `zerorun launch`.
The tests pass a `context` that forks each rank from a server that has imported torch once (a fresh
interpreter imports it for seconds, per rank and per call); the benchmarks keep fresh interpreters.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable


class RankFailure(Exception):
    """A rank raised, died or hung; the message carries that rank's traceback."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class CallersStdio:
    """The caller's stdout and stderr of the moment, handed to a rank forked from a forkserver: a spawned
    child inherits them, a forked one has the server's (pytest's capfd would not see the rank's output)."""

    def __reduce__(self) -> tuple[Any, tuple[Any, Any]]:  # runs while the rank is being started
        from multiprocessing import reduction

        return (_StdioFds, (reduction.DupFd(1), reduction.DupFd(2)))


class _StdioFds:
    def __init__(self, out: Any, err: Any) -> None:
        self.out, self.err = out, err

    def install(self) -> None:
        for wrapped, fd in ((self.out, 1), (self.err, 2)):
            os.dup2(wrapped.detach(), fd)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, threads: int, args: tuple,
           results: Any, environ: dict[str, str], stdio: Any) -> None:
    if stdio is not None:
        stdio.install()
    os.environ.clear()  # the caller's environment now, as a spawned child would have it (a forkserver's is older)
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(threads)
    results.put((rank, *run_rank(fn, rank, world_size, args)))


def run_rank(fn: Callable[..., Any], rank: int, world_size: int, args: tuple) -> tuple[bool, Any]:
    """One rank of a spawned job: `fn(rank, world_size, *args)`, then the ranks meet and the group ends.
    (True, its result), or (False, the traceback) for the parent to show."""
    import torch.distributed as dist

    from zerorun.runtime.interop import settle_all

    try:
        result = fn(rank, world_size, *args)
        settle_all()  # collectives still in flight abort a gloo process at teardown
        if dist.is_initialized():  # and so does a peer closing its connections while this rank still receives
            dist.barrier()
        return True, result
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        return False, traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


PORT_TRIES = 3  # `free_port` can lose its port to another process before rank 0's store binds it


def run_ranks(fn: Callable[..., Any], world_size: int, args: tuple = (), timeout: float = 240.0,
              threads: int = 1, context: Any = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return results in rank order.

    `fn` must be importable (module level). The first failure raises `RankFailure`; every rank
    process is gone when this returns or raises. `context`: a multiprocessing context (default: spawn).
    Ranks whose store found its port taken (seen in CI, with test files running side by side) start
    again on another: nothing ran before the store."""
    ctx = context or mp.get_context("spawn")
    for attempt in range(1, PORT_TRIES + 1):
        try:
            return _run_once(fn, world_size, args, timeout, threads, ctx)
        except RankFailure as failure:
            if attempt == PORT_TRIES or "address already in use" not in str(failure).lower():
                raise
    raise AssertionError("unreachable")


def _run_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, threads: int,
              ctx: Any) -> list[Any]:
    results = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    stdio = CallersStdio() if ctx.get_start_method() == "forkserver" else None
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, threads, args, results, environ, stdio),
                         daemon=True) for r in range(world_size)]
    for proc in procs:
        proc.start()
    values: dict[int, Any] = {}
    failure = None
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size and failure is None:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in values]
                if dead:
                    time.sleep(0.5)  # its report may still be in the pipe
                    if results.empty():
                        failure = (f"rank {dead[0]} died without reporting (exit code {procs[dead[0]].exitcode}; "
                                   "negative: killed by that signal)")
                elif time.monotonic() > deadline:
                    failure = f"timed out after {timeout:.0f}s; ranks that finished: {sorted(values)}"
                continue
            if ok:
                values[rank] = value
            else:
                failure = f"rank {rank} failed:\n{value}"
    finally:
        for proc in procs:
            proc.join(timeout=0.5 if failure else 10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failure:
        raise RankFailure(failure)
    return [values[r] for r in range(world_size)]
