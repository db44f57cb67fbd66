"""Stage 3's parameter file (`FileShard`): queued writes and read-ahead never return stale parameters.

The end-to-end proof is `test_offload.py` (NVMe parameters train bit-identically to memory); these
tests drive the file directly through the cases a training loop reaches only by chance: a write
after a read-ahead was issued, a gather order that changes, and more writes than queue slots.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from zerorun.config import AioConfig
from zerorun.runtime.stage3.param_shards import FileShard


def _file(path, sizes: list[int], tile: int = 64) -> tuple[FileShard, list[SimpleNamespace]]:
    placement = SimpleNamespace(params_nvme=str(path), run="t", rank=0, tile_numel=tile, aio=AioConfig(),
                                param_pin=False)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    units = [SimpleNamespace(group=0, state_offset=s, shard_numel=n) for s, n in zip(starts, sizes)]
    shard = FileShard(placement, [sum(sizes)], torch.float32, max(sizes))
    shard.write(0, 0, torch.arange(sum(sizes), dtype=torch.float32))
    return shard, units


def _gather(shard: FileShard, unit) -> torch.Tensor:
    out = torch.empty(unit.shard_numel)
    shard.fill(unit, out)
    return out


def _step(shard: FileShard, units, values: dict[int, float]) -> None:
    """What the optimizer does: a write per tile (tiles of 64 elements), queued."""
    for k, value in values.items():
        for lo in range(0, units[k].shard_numel, 64):
            hi = min(units[k].shard_numel, lo + 64)
            shard.target(units[k]).deliver(None, lo, hi, torch.full((hi - lo,), value))


def test_gathers_read_ahead_in_the_recorded_order_and_see_every_queued_write(direct_io_dir) -> None:
    sizes = [100, 37, 129, 64]  # pieces that start and end inside 4096-byte blocks
    shard, units = _file(direct_io_dir, sizes)
    order = [0, 1, 2, 3, 3, 2, 1, 0]  # a forward, then a backward
    for step in range(3):
        for k in order:
            got = _gather(shard, units[k])
            expected = torch.arange(units[k].state_offset, units[k].state_offset + sizes[k], dtype=torch.float32) \
                if step == 0 else torch.full((sizes[k],), float(10 * step + k))
            assert torch.equal(got, expected), (step, k)
        _step(shard, units, {k: float(10 * (step + 1) + k) for k in range(4)})
    assert shard.read_ahead["hits"] >= 2 * (len(order) - 1)  # from the second cycle on, all but the first


def test_a_write_after_a_read_ahead_was_issued_drops_it(direct_io_dir) -> None:
    shard, units = _file(direct_io_dir, [50, 70, 90])
    for _ in range(2):  # two cycles so the order is known
        for k in (0, 1, 2):
            _gather(shard, units[k])
        _step(shard, units, {0: 1.0})
    _gather(shard, units[0])  # reads unit 1 ahead
    _step(shard, units, {1: 7.0})  # ... which this write makes stale
    assert torch.equal(_gather(shard, units[1]), torch.full((70,), 7.0))
    _gather(shard, units[2])
    shard.write(0, units[0].state_offset, torch.full((50,), 3.0))  # the synchronous path (checkpoints, init)
    assert torch.equal(_gather(shard, units[0]), torch.full((50,), 3.0))


def test_a_changed_gather_order_reads_the_right_unit(direct_io_dir) -> None:
    shard, units = _file(direct_io_dir, [40, 40, 40])
    for k in (0, 1, 2):
        _gather(shard, units[k])
    _step(shard, units, {0: 1.0, 1: 2.0, 2: 3.0})
    for k in (0, 2, 1):  # read-ahead of unit 1 after unit 0 is wrong this time
        assert torch.equal(_gather(shard, units[k]), torch.full((40,), float(k + 1)))
    assert shard.read_ahead["misses"] >= 1
