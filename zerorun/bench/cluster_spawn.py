"""Run a function on ranks spread over an emulated cluster's nodes and collect each rank's result.

The cluster counterpart of `spawn.run_ranks`: every rank is a fresh `python -m zerorun.bench.cluster_spawn`
started on its node (`EmulatedCluster.exec_argv`) with torchrun's variables, the master on node 0's
address and gloo bound to the node's link. The function and its arguments travel as a pickle file;
each rank writes its result (or its traceback) to a file of its own. Every rank process is gone
when `run_ranks_on` returns or raises.
"""

from __future__ import annotations

import itertools
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from zerorun.bench.cluster import IFACE, EmulatedCluster
from zerorun.bench.spawn import RankFailure

MASTER_PORT = 29500  # node 0's port space is the cluster's own
_runs = itertools.count()


def run_ranks_on(cluster: EmulatedCluster, ranks_per_node: int, fn: Callable[..., Any], args: tuple = (),
                 timeout: float = 1800.0, threads: int = 1) -> list[Any]:
    """Run `fn(rank, world_size, *args)` with `ranks_per_node` ranks on every node; results in rank order."""
    run = next(_runs)
    directory = cluster.directory / f"run{run}"
    directory.mkdir()
    payload = directory / "payload.pkl"
    payload.write_bytes(pickle.dumps((fn, args)))
    world = len(cluster.nodes) * ranks_per_node
    procs = []
    for rank in range(world):
        node = cluster.nodes[rank // ranks_per_node]
        env = dict(os.environ, PYTHONPATH=_import_path(), MASTER_ADDR=cluster.nodes[0].address,
                   MASTER_PORT=str(MASTER_PORT + run % 1000),
                   RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank % ranks_per_node),
                   LOCAL_WORLD_SIZE=str(ranks_per_node), GLOO_SOCKET_IFNAME=IFACE, ZERORUN_BENCH_IFACE=IFACE)
        log = open(directory / f"rank{rank}.log", "wb")
        procs.append(subprocess.Popen([*cluster.exec_argv(node), sys.executable, "-m", __name__, str(payload),
                                       str(directory / f"rank{rank}.pkl"), str(threads)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        _wait(procs, directory, timeout)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return [pickle.loads((directory / f"rank{rank}.pkl").read_bytes())[1] for rank in range(world)]


def _import_path() -> str:
    """This process's import path, for the ranks: the pickled function's module (a test's, say) must import
    there as it does here, whatever directory the rank starts in (as multiprocessing passes sys.path on)."""
    here = [os.path.abspath(p or os.curdir) for p in sys.path]
    return os.pathsep.join(dict.fromkeys([*here, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]))


def _wait(procs: list[subprocess.Popen[bytes]], directory: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(proc.poll() is None for proc in procs):
        failed = [rank for rank, proc in enumerate(procs) if proc.poll() not in (None, 0)]
        if failed:
            raise RankFailure(f"rank {failed[0]} failed:\n{_report(directory, failed[0])}")
        if time.monotonic() > deadline:
            raise RankFailure(f"timed out after {timeout:.0f}s")
        time.sleep(0.2)
    for rank, proc in enumerate(procs):
        if proc.returncode != 0 or not (directory / f"rank{rank}.pkl").exists():
            raise RankFailure(f"rank {rank} failed:\n{_report(directory, rank)}")


def _report(directory: Path, rank: int) -> str:
    result = directory / f"rank{rank}.pkl"
    if result.exists():
        ok, value = pickle.loads(result.read_bytes())
        if not ok:
            return value
    return (directory / f"rank{rank}.log").read_text(errors="replace")[-4000:]


def _main(payload: str, result: str, threads: str) -> int:
    import torch

    from zerorun.bench.spawn import run_rank

    torch.set_num_threads(int(threads))
    fn, args = pickle.loads(Path(payload).read_bytes())
    outcome = run_rank(fn, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args)
    Path(result).write_bytes(pickle.dumps(outcome))
    return 0 if outcome[0] else 1


if __name__ == "__main__":
    code = _main(*sys.argv[1:4])
    # Ends as a multiprocessing rank does (os._exit): the result is written, and the interpreter's finalization
    # would only destroy what outlived destroy_process_group() (a gloo group an engine still references), where
    # a gloo worker thread still joinable aborts the process ("terminate called without an active exception",
    # seen once in CI on a rank whose result was already written)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
