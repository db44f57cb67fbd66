"""Collectives across emulated nodes: the right sums, shared memory within a node only, each byte on the link once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from zerorun.bench.cluster_spawn import run_ranks_on

pytestmark = pytest.mark.slow  # emulated nodes and a shaped link

NUMEL = 2**20  # 4 MiB of fp32


def _reduce_scatter_over_the_link(rank: int, world: int, quantized: bool = False) -> dict:
    import os

    import torch.distributed as dist

    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    comm = Collectives(cpu="auto", quantized_gradients=quantized)  # auto: no shared memory across nodes: gloo
    counter = Path(f"/sys/class/net/{os.environ['ZERORUN_BENCH_IFACE']}/statistics/tx_bytes")
    full = (rank + 1) * torch.arange(NUMEL, dtype=torch.float32)
    out = torch.empty(NUMEL // world)
    dist.barrier()
    before = int(counter.read_text())
    comm.reduce_scatter(full, out).wait()
    dist.barrier()  # my sends are done when the kernel has them; my peer's when it has received them
    sent = int(counter.read_text()) - before
    expected = sum(r + 1 for r in range(world)) * torch.arange(NUMEL, dtype=torch.float32).view(world, -1)[rank]
    right = torch.equal(out, expected) if not quantized else torch.allclose(out, expected, rtol=0.02, atol=0.02 * NUMEL)
    return {"transport": comm.transport, "sent": sent, "right": right}


def test_a_reduce_scatter_across_two_nodes_sends_each_byte_over_the_link_once(cluster):
    results = run_ranks_on(cluster.cluster, 1, _reduce_scatter_over_the_link)
    assert [r["transport"] for r in results] == ["gloo", "gloo"]
    assert all(r["right"] for r in results)
    half = NUMEL * 4 // 2  # the piece the other node owns; an all-reduce would send all of it
    for r in results:
        assert half <= r["sent"] < 1.1 * half, (r["sent"], half)


def test_quantized_gradients_cross_the_link_in_a_quarter_of_the_bytes(cluster):
    results = run_ranks_on(cluster.cluster, 1, _reduce_scatter_over_the_link, (True,))
    assert all(r["right"] for r in results)
    quarter = NUMEL * 4 // 2 // 4  # int8 for fp32, plus an fp32 scale per 2048 elements
    for r in results:
        assert quarter <= r["sent"] < 1.15 * quarter, (r["sent"], quarter)
