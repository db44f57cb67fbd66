"""Collectives: each operation gives the same result on a world of one and on gloo with 2 and 3 ranks,
follow-up work runs once, and bytes and calls are counted per kind."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks

PIECE = 5  # elements per rank: odd, so nothing lines up by accident


def _exercise(rank: int, world: int) -> dict:
    from zerorun.runtime.collectives import Collectives, Pending
    from zerorun.runtime.dist import init_distributed

    init_distributed()
    comm = Collectives()
    # every rank contributes (rank + 1) * (1, 2, 3, ...): sums are known in closed form
    mine = lambda: (rank + 1) * torch.arange(1, world * PIECE + 1, dtype=torch.float32)  # noqa: E731
    total = sum(r + 1 for r in range(world)) * torch.arange(1, world * PIECE + 1, dtype=torch.float32)
    out = {}
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
    out["stats"] = {kind: (entry["calls"], entry["bytes"]) for kind, entry in comm.stats.as_dict().items()}
    return out


@pytest.mark.parametrize("world", [1, 2, 3])
def test_collectives_give_the_sums_and_pieces_they_promise(world: int) -> None:
    for rank, out in enumerate(run_ranks(_exercise, world)):
        stats = out.pop("stats")
        assert all(out.values()), (rank, out)
        nbytes = world * PIECE * 4
        assert stats == {"all_reduce": (1, nbytes), "reduce_scatter": (3, 3 * nbytes), "all_gather": (1, nbytes),
                         "broadcast": (1, 12)}, stats
