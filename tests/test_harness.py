"""The multi-rank harness forks ranks from a server that imported torch once; each rank must still see
what a freshly spawned one would: the caller's environment as it is at the call, torchrun's variables,
a process of its own."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from tests.harness import run_ranks, run_threads, seeded
from tests.rank_threads import run_threads as run_rank_threads
from zerorun.bench.spawn import RankFailure


def _what_a_rank_sees(rank: int, world: int) -> tuple[str | None, str, str, int]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return os.environ.get("ZR_HARNESS_PROBE"), os.environ["RANK"], os.environ["WORLD_SIZE"], os.getpid()


def test_each_rank_sees_the_callers_environment_of_the_moment_and_its_own_rank(monkeypatch: pytest.MonkeyPatch):
    run_ranks(_what_a_rank_sees, 2)  # the server exists from here on: its own environment is older
    token = uuid.uuid4().hex
    monkeypatch.setenv("ZR_HARNESS_PROBE", token)
    seen = run_ranks(_what_a_rank_sees, 2)
    assert [s[:3] for s in seen] == [(token, "0", "2"), (token, "1", "2")]
    assert len({s[3] for s in seen} | {os.getpid()}) == 3  # processes of their own
    monkeypatch.delenv("ZR_HARNESS_PROBE")
    assert {s[0] for s in run_ranks(_what_a_rank_sees, 2)} == {None}


def _say(rank: int, world: int) -> None:
    print(f"rank {rank} says hello", flush=True)


def test_what_a_rank_prints_reaches_the_callers_stdout_of_the_moment(capfd: pytest.CaptureFixture[str]) -> None:
    run_ranks(_say, 2)  # (a forked rank would write to the server's stdout, captured by an earlier test)
    out = capfd.readouterr().out
    assert "rank 0 says hello" in out and "rank 1 says hello" in out


# -- ranks as threads ---------------------------------------------------------------------------------------------
def _pairwise_and_a_subgroup(rank: int, world: int) -> tuple[str, int, list[float], list[float]]:
    """What the runtime's collectives need of a rank: its own gloo group, point to point and subgroups."""
    import torch
    import torch.distributed as dist

    right, left = (rank + 1) % world, (rank - 1) % world
    received = torch.zeros(2)
    works = [dist.isend(torch.full((2,), float(rank)), right), dist.irecv(received, left)]
    for work in works:
        work.wait()
    pair = dist.new_group([0, 1])
    total = torch.tensor([float(rank + 1)])
    if rank in (0, 1):
        dist.all_reduce(total, group=pair)
    return dist.get_backend(), dist.get_rank(), received.tolist(), total.tolist()


def test_rank_threads_are_gloo_ranks_of_their_own_with_point_to_point_and_subgroups() -> None:
    seen = run_threads(_pairwise_and_a_subgroup, 3)
    assert seen == [("gloo", 0, [2.0, 2.0], [3.0]), ("gloo", 1, [0.0, 0.0], [3.0]), ("gloo", 2, [1.0, 1.0], [3.0])]


def _from_a_thread_of_the_rank(rank: int, world: int) -> float:
    """A worker thread the rank starts (as the codec's) issues a collective on the rank's default group."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    with ThreadPoolExecutor(1) as worker:
        worker.submit(dist.all_reduce, total).result()
    return float(total)


def test_a_thread_a_rank_thread_starts_is_in_that_ranks_world() -> None:
    assert run_threads(_from_a_thread_of_the_rank, 3) == [6.0, 6.0, 6.0]


def _rank_one_fails(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank 1's own mistake")
    dist.all_reduce(torch.ones(1))  # waits for rank 1, whose group goes away


def test_a_failing_rank_thread_fails_the_call_at_once_with_its_traceback() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed:.*ValueError: rank 1's own mistake"):
        run_rank_threads(_rank_one_fails, 2, timeout=120)
    assert time.monotonic() - started < 30


def _seeds_alone(rank: int, world: int) -> list[float]:
    import torch

    with seeded(7):
        drawn = torch.randn(3).tolist()
    with pytest.raises(AssertionError, match="seeded"):
        torch.manual_seed(7)
    return drawn


def test_rank_threads_seed_one_at_a_time_and_leave_the_process_as_it_was() -> None:
    import torch
    import torch.distributed as dist

    threads, seed, world = torch.get_num_threads(), torch.manual_seed, dist.distributed_c10d._world
    first, second = run_threads(_seeds_alone, 2)
    assert first == second  # each rank drew its own seed's numbers, none of the other's
    assert (torch.get_num_threads(), torch.manual_seed, dist.distributed_c10d._world) == (threads, seed, world)
    assert not dist.is_initialized()


def _joins_the_world(rank: int, world: int) -> int:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.destroy_process_group()
    return rank


def test_ranks_whose_port_was_taken_before_their_store_bound_it_start_again_on_another(monkeypatch) -> None:
    """`free_port` closes its socket before rank 0's store binds the port, so another process can take it first
    (CI, test files side by side: "Address already in use"); nothing ran yet, so the ranks start again."""
    import socket

    from zerorun.bench import spawn

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], spawn.free_port()])
    monkeypatch.setattr(spawn, "free_port", lambda: next(ports))
    try:
        assert spawn.run_ranks(_joins_the_world, 2, timeout=120) == [0, 1]
    finally:
        taken.close()
