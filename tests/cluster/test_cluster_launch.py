"""`zerorun launch` over SSH across emulated nodes: separate hosts, shaped link, shared memory only within a node."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # emulated nodes, an sshd on each


def test_two_nodes_launch_over_ssh_and_all_reduce_across_the_link(launch_on_cluster):
    job = launch_on_cluster("../../cluster/scripts/where.py", nproc=1)
    assert job.wait(timeout=120) == 0, job.output
    assert "[10.77.0.1:0] rank 0 host node0 shm zrc-test-rank0 sum 3" in job.stdout, job.output
    assert "[10.77.0.2:1] rank 1 host node1 shm zrc-test-rank1 sum 3" in job.stdout, job.output
    assert job.leftovers() == []


def test_two_ranks_per_node_share_memory_within_their_node_only(launch_on_cluster):
    job = launch_on_cluster("../../cluster/scripts/where.py", nproc=2)
    assert job.wait(timeout=120) == 0, job.output
    for rank, host, pair in ((0, "node0", "0,zrc-test-rank1"), (3, "node1", "2,zrc-test-rank3")):
        assert any(line.endswith(f"rank {rank} host {host} shm zrc-test-rank{pair} sum 10") for line in job.stdout), \
            job.output
    assert job.leftovers() == []
