"""Collectives across emulated nodes: the right sums, shared memory within a node only, each byte on the link once."""

from __future__ import annotations

from pathlib import Path

import torch

from zerorun.bench.cluster_spawn import run_ranks_on

NUMEL = 2**20  # 4 MiB of fp32


def _reduce_scatter_over_the_link(rank: int, world: int) -> dict:
    import os

    import torch.distributed as dist

    from zerorun.runtime.collectives import Collectives
    from zerorun.runtime.dist import init_distributed

    init_distributed()
    comm = Collectives(cpu="auto")  # auto: shared memory is impossible across nodes, so gloo carries it
    counter = Path(f"/sys/class/net/{os.environ['ZERORUN_BENCH_IFACE']}/statistics/tx_bytes")
    full = (rank + 1) * torch.arange(NUMEL, dtype=torch.float32)
    out = torch.empty(NUMEL // world)
    dist.barrier()
    before = int(counter.read_text())
    comm.reduce_scatter(full, out).wait()
    dist.barrier()  # my sends are done when the kernel has them; my peer's when it has received them
    sent = int(counter.read_text()) - before
    expected = sum(r + 1 for r in range(world)) * torch.arange(NUMEL, dtype=torch.float32).view(world, -1)[rank]
    return {"transport": comm.transport, "sent": sent, "right": torch.equal(out, expected)}


def test_a_reduce_scatter_across_two_nodes_sends_each_byte_over_the_link_once(cluster):
    results = run_ranks_on(cluster.cluster, 1, _reduce_scatter_over_the_link)
    assert [r["transport"] for r in results] == ["gloo", "gloo"]
    assert all(r["right"] for r in results)
    half = NUMEL * 4 // 2  # the piece the other node owns; an all-reduce would send all of it
    for r in results:
        assert half <= r["sent"] < 1.1 * half, (r["sent"], half)
