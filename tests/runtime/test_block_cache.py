"""BlockCache: stage 3's gathered buffers get their host memory back at the same sizes, without the allocator."""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from zerorun.runtime.memory import BlockCache

pytestmark = pytest.mark.skipif(not BlockCache.supported(), reason="this torch cannot swap storages' memory")


def _emptied(numel: int) -> torch.Tensor:
    buffer = torch.empty(numel)
    buffer.untyped_storage().resize_(0)
    return buffer


def test_a_released_block_is_the_memory_of_the_next_fill_of_its_size() -> None:
    cache, a, b = BlockCache(), _emptied(1024), _emptied(1024)
    cache.fill(a.untyped_storage(), 4096)
    first = a.untyped_storage().data_ptr()
    cache.take(a.untyped_storage())
    assert a.untyped_storage().nbytes() == 0 and cache.idle_bytes() == 4096
    cache.fill(b.untyped_storage(), 4096)
    assert b.untyped_storage().data_ptr() == first and cache.idle_bytes() == 0
    other = _emptied(10)
    cache.fill(other.untyped_storage(), 40)  # another size: a new block, the 4096 one stays with b
    assert other.untyped_storage().data_ptr() != first
    cache.take(b.untyped_storage())
    cache.take(other.untyped_storage())
    assert cache.idle_bytes() == 4096 + 40
    cache.drop_idle()
    assert cache.idle_bytes() == 0


def test_views_and_tensors_autograd_saved_see_the_memory_of_a_refill() -> None:
    """What stage 3 relies on: `x @ w.t()` saves `w`, a view of the unit's buffer; the buffer is
    released after forward and filled again (here with another block) before backward."""
    cache, full = BlockCache(), _emptied(6)
    cache.fill(full.untyped_storage(), 24)
    values = torch.arange(6.0)
    full.copy_(values)
    weight = torch.nn.Parameter(torch.empty(0))
    weight.data = full.view(2, 3)  # as the engine points a parameter at its unit's buffer
    x = torch.randn(4, 3, requires_grad=True)
    out = x @ weight.t()
    cache.take(full.untyped_storage())
    squatter = _emptied(6)
    cache.fill(squatter.untyped_storage(), 24)  # the block it had is in use elsewhere now
    squatter.fill_(-1.0)
    cache.fill(full.untyped_storage(), 24)
    assert full.untyped_storage().data_ptr() != squatter.untyped_storage().data_ptr()
    full.copy_(values)
    out.backward(torch.ones(4, 2))
    assert torch.equal(x.grad, torch.ones(4, 2) @ values.view(2, 3))
    assert torch.equal(weight.grad, torch.ones(2, 4) @ x.detach())


def _stage3_blocks(rank: int, world: int) -> dict:
    import zerorun
    from zerorun import config

    out = {}
    for host_memory in ("fast", "lean"):
        recipe = config.loads("script: t.py", "t.yaml", ["zero.stage=3", f"zero.host_memory={host_memory}",
                                                          "zero.allgather_bucket_mb=0.05"])
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)])
        engine = zerorun.initialize(model, None, recipe)
        x = torch.randn(8, 64)
        during = []
        engine.reducer.launch = _spy(engine.reducer.launch, lambda: during.append(
            engine.store.buffers.blocks.idle_bytes()))
        for _ in range(2):
            engine.backward(engine(x).pow(2).mean())
            engine.step()
        idle_after = engine.store.buffers.blocks.idle_bytes()
        out[host_memory] = (isinstance(engine.store.buffers.blocks, BlockCache), max(during), idle_after)
        engine.destroy()
    return out


def _spy(method, before):
    def spied(*args, **kwargs):
        before()
        return method(*args, **kwargs)
    return spied


def test_stage3_on_cpu_reuses_blocks_and_hands_them_back_after_backward() -> None:
    for result in run_ranks(_stage3_blocks, 2):
        for host_memory in ("fast", "lean"):
            cached, idle_during_backward, idle_after = result[host_memory]
            assert cached and idle_during_backward > 0, result  # units released after forward wait for backward
            assert idle_after == 0, result  # end of backward: handed back, nothing held through the step
