"""The pieces the optimizer step streams through: the staging ring, direct transfers, and memory homes."""

from __future__ import annotations

import pytest
import torch

from zerorun.runtime.homes import MemoryHome
from zerorun.runtime.memory import MemoryReport
from zerorun.runtime.transfers import Direct, StagingRing


def test_the_staging_ring_hands_out_each_tile_and_reuses_its_two_slots() -> None:
    ring = StagingRing(torch.device("cpu"), tile_numel=4, pin=False)
    tiles = [torch.arange(4.0) + 10 * k for k in range(5)]
    ring.begin(tiles)
    fetched = [ring.fetch(k) for k in range(5)]
    # a fetched tile is valid until the fetch two later: slots alternate
    assert fetched[4].data_ptr() == fetched[2].data_ptr() == fetched[0].data_ptr() != fetched[1].data_ptr()
    assert torch.equal(fetched[4], tiles[4]) and torch.equal(fetched[3], tiles[3])
    dest = torch.zeros(8, dtype=torch.bfloat16)
    for k in range(2):
        assert not ring.reaches(dest[4 * k:4 * k + 4])  # CPU-only: "device" parameters go through the ring too
        slot = ring.out_slot(4, torch.bfloat16)
        slot.copy_(torch.full((4,), k + 1.0))
        ring.send(dest[4 * k:4 * k + 4], slot)
    ring.finish()
    assert dest.tolist() == [1.0] * 4 + [2.0] * 4
    stats = ring.stats()
    assert stats["d2h"]["bytes"] == 5 * 4 * 4 and stats["h2d"]["bytes"] == 8 * 2
    assert ring.held_bytes() == 2 * (4 * 4) + 2 * (4 * 4)


def test_direct_transfers_move_nothing() -> None:
    direct = Direct()
    grads = [torch.ones(3), torch.zeros(2)]
    direct.begin(grads)
    assert direct.fetch(1) is grads[1] and direct.reaches(torch.empty(1))
    assert direct.stats() == {} and direct.held_bytes() == 0
    with pytest.raises(AssertionError):
        direct.out_slot(3, torch.float32)


def test_a_memory_home_around_the_parameters_reads_and_writes_across_their_pieces() -> None:
    params = torch.arange(10.0)
    pieces = [[(0, params[0:4]), (4, params[6:10])]]  # two units' pieces of one group: state elements 0..7
    home = MemoryHome([8], torch.device("cpu"), master=pieces)
    out = torch.empty(4)
    home.read(0, "master", out, start=2)  # crosses from the first piece into the second
    assert out.tolist() == [2.0, 3.0, 6.0, 7.0]
    home.write(0, "master", torch.tensor([-1.0, -2.0]), start=3)
    assert params.tolist() == [0, 1, 2, -1, 4, 5, -2, 7, 8, 9]
    assert home.state(0, "master").tolist() == [0, 1, 2, -1, -2, 7, 8, 9]
    seen = []
    home.visit(0, [(0, 4), (5, 8)], lambda k, m, v, w: seen.append((k, m.tolist(), v.numel())))
    assert seen == [(0, [0, 1, 2, -1], 4), (1, [7, 8, 9], 3)]
    report = MemoryReport()
    home.account(report)
    assert report.total("master") == 0 and report.total("optimizer") == 2 * 8 * 4  # the master is the parameters


def test_a_memory_home_of_its_own_counts_its_master() -> None:
    home = MemoryHome([3, 5], torch.device("cpu"))
    home.write(1, "exp_avg", torch.ones(2), start=3)
    assert home.state(1, "exp_avg").tolist() == [0, 0, 0, 1, 1]
    report = MemoryReport()
    home.account(report)
    assert report.total("master") == 8 * 4 and report.total("optimizer") == 16 * 4
