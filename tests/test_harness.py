"""The multi-rank harness forks ranks from a server that imported torch once; each rank must still see
what a freshly spawned one would: the caller's environment as it is at the call, torchrun's variables,
a process of its own."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.harness import run_ranks


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
