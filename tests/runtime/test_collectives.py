"""Collectives: each operation gives the same result on a world of one and on 2 and 3 ranks, through gloo
and through shared memory (with slots so small that every operation takes several uneven chunks),
follow-up work runs once, and bytes and calls are counted per kind. Shared memory gives gloo's bits
with 2 ranks and the same bits on every rank with 3; a host where it cannot work falls back or refuses."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.harness import run_ranks, run_threads
from zerorun.runtime.comm import shm_collectives

PIECE = 5  # elements per rank: odd, so nothing lines up by accident


def _exercise(rank: int, world: int, cpu: str = "gloo") -> dict:
    from zerorun.runtime.comm.collectives import Collectives, Pending
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    comm = Collectives(cpu=cpu)
    assert comm.transport == ("shared memory" if cpu == "shm" and world > 1 else "gloo"), comm.transport
    # every rank contributes (rank + 1) * (1, 2, 3, ...): sums are known in closed form
    mine = lambda: (rank + 1) * torch.arange(1, world * PIECE + 1, dtype=torch.float32)  # noqa: E731
    total = sum(r + 1 for r in range(world)) * torch.arange(1, world * PIECE + 1, dtype=torch.float32)
    out = {}
    # the tags cross a wire on a gloo group of their own, never queued behind the payload's transfers (tags.py);
    # shared memory carries them in its header and makes no group for them
    assert comm.tags is not None
    on_own_group = comm.tags._wire is not comm.group
    out["tags' group"] = on_own_group == (world > 1 and comm.transport == "gloo")
    summed = mine()
    comm.all_reduce(summed).wait()
    out["all_reduce"] = torch.equal(summed, total)
    piece = torch.full((PIECE,), -1.0)
    comm.reduce_scatter(mine(), piece).wait()
    out["reduce_scatter"] = torch.equal(piece, total[rank * PIECE:(rank + 1) * PIECE])
    acc = torch.ones(PIECE)
    comm.reduce_scatter(mine(), acc, accumulate=True).wait()
    out["reduce_scatter_accumulate"] = torch.equal(acc, 1 + total[rank * PIECE:(rank + 1) * PIECE])
    gathered = torch.zeros(world * PIECE)
    gathered[rank * PIECE:(rank + 1) * PIECE] = rank + 0.5  # only this rank's piece is in place
    comm.all_gather(gathered).wait()
    out["all_gather"] = torch.equal(gathered, torch.arange(world).float().repeat_interleave(PIECE) + 0.5)
    sent = torch.full((3,), float(rank))
    comm.broadcast(sent, src=world - 1).wait()
    out["broadcast"] = torch.equal(sent, torch.full((3,), float(world - 1)))
    calls = []
    handle = comm.reduce_scatter(mine(), torch.zeros(PIECE))
    pending = Pending([handle], then=lambda: calls.append("then"))
    pending.wait()
    pending.wait()
    handle.wait()
    out["then_once"] = calls == ["then"] and pending.done and handle.done
    out["tags checked"] = world == 1 or comm.tags.seq > 0
    level = "node_bytes" if comm.transport == "shared memory" else "network_bytes"
    out["stats"] = {kind: (entry["calls"], entry[level]) for kind, entry in comm.stats.as_dict().items()}
    return out


@pytest.mark.parametrize("cpu", ["gloo", "shm"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_give_the_sums_and_pieces_they_promise(world: int, cpu: str, monkeypatch) -> None:
    monkeypatch.setattr(shm_collectives, "SLOT_BYTES", 24)  # 6 fp32 per slot: a 5-element piece takes 2 or 3 chunks
    for rank, out in enumerate(run_threads(_exercise, world, (cpu,))):
        stats = out.pop("stats")
        assert all(out.values()), (rank, out)
        nbytes = world * PIECE * 4
        assert stats == {"all_reduce": (1, nbytes), "reduce_scatter": (3, 3 * nbytes), "all_gather": (1, nbytes),
                         "broadcast": (1, 12)}, stats


def _trimmed(rank: int, world: int, cpu: str) -> dict:
    """The owner way's units (partition.whole_layout): each rank's piece carries values only at its start, the
    rest is padding, zero on every rank; only the carrying part moves, and the counts say so."""
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    comm = Collectives(cpu=cpu)
    piece, used = 7, [7, 2, 5][:world]  # uneven, one piece full and one mostly padding
    full = torch.zeros(world, piece)
    for r in range(world):
        full[r, :used[r]] = (rank + 1) * torch.arange(1, used[r] + 1, dtype=torch.float32) + 10 * r
    total = sum(range(1, world + 1))
    want = torch.zeros(piece)
    want[:used[rank]] = total * torch.arange(1, used[rank] + 1, dtype=torch.float32) + 10 * rank * world
    out = {}
    got = torch.full((piece,), -1.0)
    comm.reduce_scatter(full.clone().view(-1), got, used=used).wait()
    out["reduce_scatter"] = torch.equal(got, want)
    acc = torch.ones(piece)
    comm.reduce_scatter(full.clone().view(-1), acc, accumulate=True, used=used).wait()
    out["reduce_scatter_accumulate"] = torch.equal(acc, want + 1)
    gathered = torch.full((world, piece), -7.0)
    gathered[rank, :used[rank]] = rank + 0.5
    comm.all_gather(gathered.view(-1), used=used).wait()
    out["all_gather"] = all(torch.equal(gathered[r, :used[r]], torch.full((used[r],), r + 0.5)) and
                            bool((gathered[r, used[r]:] == -7.0).all()) for r in range(world) if r != rank)
    level = "node_bytes" if comm.transport == "shared memory" else "network_bytes"
    out["stats"] = {kind: (entry["calls"], entry[level]) for kind, entry in comm.stats.as_dict().items()}
    return out


@pytest.mark.parametrize("cpu", ["gloo", "shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_a_whole_layouts_collectives_move_only_the_values_each_piece_carries(world: int, cpu: str,
                                                                              monkeypatch) -> None:
    monkeypatch.setattr(shm_collectives, "SLOT_BYTES", 24)  # several chunks, the pieces ending in different ones
    for rank, out in enumerate(run_threads(_trimmed, world, (cpu,))):
        stats = out.pop("stats")
        assert all(out.values()), (rank, out)
        moved = sum([7, 2, 5][:world]) * 4
        assert stats == {"reduce_scatter": (2, 2 * moved), "all_gather": (1, moved)}, stats


def _in_flight(rank: int, world: int, cpu: str) -> dict:
    """Exchanges posted back to back before any is waited for, each rank's piece a different size (gloo's
    point-to-point notices must not get crossed between them): each takes the next lane over gloo."""
    from zerorun.runtime.comm import pairwise
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    comm = Collectives(cpu=cpu)
    lanes: list[object] = []  # the lane each exchange went on (None: the group's own connections)
    post = comm._post

    def noted(*args: Any) -> list:
        lanes.append(args[3] if len(args) > 3 else None)
        return post(*args)
    comm._post = noted  # type: ignore[method-assign]
    piece, rounds = 9, 6
    used = [[1 + (r + k) % piece for r in range(world)] for k in range(rounds)]  # the fuller piece moves round
    gathered, reduced, handles = [], [], []
    for k in range(rounds):
        full = torch.full((world, piece), -7.0)
        full[rank, :used[k][rank]] = 100 * k + rank
        gathered.append(full)
        handles.append(comm.all_gather(full.view(-1), used=used[k]))
        out = torch.full((piece,), -1.0)
        reduced.append(out)
        handles.append(comm.reduce_scatter(torch.full((world * piece,), float(k + rank)), out, used=used[k]))
    for handle in reversed(handles):  # waited for in another order than posted
        handle.wait()
    result = {"lanes": len(comm.lanes) == (pairwise.LANES if cpu == "gloo" and world > 1 else 0)}
    result["gathered"] = all(torch.equal(gathered[k][r, :used[k][r]], torch.full((used[k][r],), 100.0 * k + r))
                             for k in range(rounds) for r in range(world))
    sums = [float(sum(k + r for r in range(world))) for k in range(rounds)]
    result["reduced"] = all(torch.equal(reduced[k][:used[k][rank]], torch.full((used[k][rank],), sums[k]))
                            for k in range(rounds))
    if comm.lanes:  # every exchange on a lane, never the one before it, all of them in turn
        result["in turn"] = (all(lane is not None for lane in lanes)
                             and all(a is not b for a, b in zip(lanes, lanes[1:]))
                             and {id(lane) for lane in lanes} == {id(lane) for lane in comm.lanes})
    return result


@pytest.mark.parametrize("cpu", ["gloo", "shm"])
@pytest.mark.parametrize("world", [2, 3])
def test_exchanges_in_flight_together_take_turns_over_gloos_connections(world: int, cpu: str) -> None:
    # gloo sends a payload once the receiver's notice of its posted receive arrives, queued behind the receiver's
    # own payloads on that connection: exchanges sharing one go in lockstep (pairwise.py)
    for rank, out in enumerate(run_threads(_in_flight, world, (cpu,))):
        assert all(out.values()), (rank, out)


@pytest.mark.parametrize("setting", ["0", "two", "-1"])
def test_a_lane_count_that_is_not_a_whole_number_of_connections_is_refused_naming_it(setting: str,
                                                                                     monkeypatch) -> None:
    from zerorun.errors import ZerorunError
    from zerorun.runtime.comm.pairwise import make_lanes

    monkeypatch.setenv("ZERORUN_WIRE_LANES", setting)
    with pytest.raises(ZerorunError, match=f"ZERORUN_WIRE_LANES='{setting}': expected a whole number"):
        make_lanes(10.0)


def _both_transports(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    gloo, shm = Collectives(cpu="gloo"), Collectives(cpu="shm")
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        data = torch.randn(world * 3001, generator=gen).to(dtype)
        start = torch.randn(3001, generator=gen).to(dtype)
        for name, run in [
            ("all_reduce", lambda c, t: c.all_reduce(t).wait() or t),
            ("all_reduce_avg", lambda c, t: c.all_reduce(t, op=dist.ReduceOp.AVG).wait() or t),
            ("all_reduce_max", lambda c, t: c.all_reduce(t, op=dist.ReduceOp.MAX).wait() or t),
            ("reduce_scatter", lambda c, t: (o := torch.empty(3001, dtype=dtype), c.reduce_scatter(t, o).wait())[0]),
            ("reduce_scatter_acc", lambda c, t: (o := start.clone(), c.reduce_scatter(t, o, accumulate=True).wait())[0]),
            # stage 1's form: `out` is this rank's own piece of the input
            ("reduce_scatter_in_place", lambda c, t: (c.reduce_scatter(t, t.view(world, -1)[rank]).wait(),
                                                      t.view(world, -1)[rank])[1]),
            ("all_gather", lambda c, t: c.all_gather(t).wait() or t),
            ("broadcast", lambda c, t: c.broadcast(t, src=world - 1).wait() or t),
        ]:
            out[(str(dtype), name)] = (run(gloo, data.clone()).float().tolist(), run(shm, data.clone()).float().tolist())
    return out  # plain lists: tensors would travel back through shared files the exiting rank removes


@pytest.mark.parametrize("world", [2, 3])
def test_shared_memory_gives_gloos_bits_with_two_ranks_and_one_answer_on_every_rank(world: int, monkeypatch) -> None:
    monkeypatch.setattr(shm_collectives, "SLOT_BYTES", 4096)  # a 3001-element piece: several chunks in every dtype
    results = run_threads(_both_transports, world)
    for key in results[0]:
        for rank_result in results[1:]:  # every rank holds the same bits (replicas must not drift)
            if "reduce_scatter" not in key[1]:
                assert rank_result[key][1] == results[0][key][1], key
    for rank, key in ((rank, key) for rank in range(world) for key in results[rank]):  # each rank's own piece
        by_gloo, by_shm = (torch.tensor(x) for x in results[rank][key])
        if world == 2 or key[1] in ("all_gather", "broadcast", "all_reduce_max") or "reduce_scatter" in key[1]:
            # a + b is a + b in any order: gloo's very bits; reduce-scatters sum in rank order on both transports
            assert torch.equal(by_gloo, by_shm), (rank, key)
        else:  # three summands: gloo's ring adds them in another order. Each of the two additions rounds
            # once (half a unit u of a result below 3 x 5 in magnitude, randn staying under 5 here), so
            # the two orders differ by at most 2 x 2 x u/2 x 15 (fp16 and bf16 also round the summands' sum)
            assert torch.allclose(by_gloo, by_shm, rtol=0, atol=4 * _UNIT[key[0]] * 3 * 5), (rank, key)


_UNIT = {str(torch.float32): 2.0**-24, str(torch.bfloat16): 2.0**-8, str(torch.float16): 2.0**-11}


def _without_shm(rank: int, world: int, setting: str) -> str:
    from zerorun.errors import ZerorunError
    from zerorun.runtime.comm import shm_collectives
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    shm_collectives.SHM_DIR = "/nonexistent-shm"  # as on a host without a writable /dev/shm
    try:
        return Collectives(cpu=setting).transport
    except ZerorunError as err:
        return f"refused: {err}"


def test_without_shared_memory_auto_falls_back_to_gloo_and_shm_refuses_naming_why() -> None:
    # rank processes: each takes /dev/shm away from its whole process
    assert run_ranks(_without_shm, 2, ("auto",)) == ["gloo", "gloo"]
    for answer in run_ranks(_without_shm, 2, ("shm",)):
        assert answer.startswith("refused: zero.cpu_collectives: shm is not possible here: rank 0: cannot reserve"), answer
        assert "(No such file or directory)" in answer and "Use auto" in answer, answer


def _one_rank_stays_away(rank: int, world: int) -> str:
    import time

    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    comm = Collectives(cpu="shm", timeout_s=2.0)
    if rank == 1:  # alive but elsewhere (a rank thread: its process lives on, so the exit check cannot end rank
        return "stayed away"  # 0's wait; the timeout must)
    first, queued = comm.all_reduce(torch.ones(10)), comm.all_reduce(torch.ones(10))
    answers = []
    for handle in (first, queued):
        started = time.monotonic()
        try:
            handle.wait()
            answers.append("returned without rank 1")
        except RuntimeError as err:
            answers.append(f"{err} after {time.monotonic() - started:.0f} s")
    return "\n".join(answers)


def test_a_rank_that_never_arrives_is_an_error_naming_it_after_the_timeout_not_a_hang() -> None:
    first, queued = run_threads(_one_rank_stays_away, 2)[0].split("\n")
    assert first.startswith("shared-memory collective: rank 1 did not arrive within 2 s"), first
    # the one queued behind it fails at once (it waited out another timeout before), naming the first failure
    assert queued.startswith("shared-memory collective not run: an earlier one failed (shared-memory collective: "
                             "rank 1 did not arrive within 2 s") and queued.endswith(" after 0 s"), queued
