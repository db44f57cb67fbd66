"""Hierarchical collectives (hier_collectives.py): 2 "nodes" x 2 ranks on one host, the launcher's
LOCAL_WORLD_SIZE saying 2 per node. Within a node they go through shared memory, across through gloo."""

from __future__ import annotations

import os

import pytest
import torch

from tests.harness import run_ranks
from tests.runtime.test_engine_parity import _compare

NODE = "2"  # ranks per node


def _as_nodes(rank: int, world: int, fn, *args):
    os.environ["LOCAL_WORLD_SIZE"] = NODE
    return fn(rank, world, *args)


def _collectives(rank: int, world: int) -> dict:
    from zerorun.runtime.comm.collectives import Collectives
    from zerorun.runtime.comm.dist import init_distributed

    init_distributed()
    os.environ["LOCAL_WORLD_SIZE"] = NODE
    comm = Collectives(cpu="auto")
    assert comm.hier is not None, "4 ranks, 2 per node: hierarchical"
    n = 4 * 3001  # pieces of 3001: no alignment to hide a wrong offset
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    exact = torch.stack([x.double() for x in inputs]).sum(0).view(world, -1)[rank]
    out = torch.full((n // world,), 0.5)
    comm.reduce_scatter(inputs[rank].clone(), out, accumulate=True).wait()
    full = torch.zeros(n)
    full.view(world, -1)[rank] = inputs[rank].view(world, -1)[rank]
    comm.all_gather(full).wait()
    stats = comm.stats.as_dict()
    return {"rs_error": (out.double() - 0.5 - exact).abs().max().item(),
            "gathered": torch.equal(full.view(world, -1)[:, 0], torch.stack([x.view(world, -1)[r, 0]
                                                                              for r, x in enumerate(inputs)])),
            "levels": {kind: (entry["node_bytes"], entry["network_bytes"]) for kind, entry in stats.items()},
            "transport": comm.transport, "quantized_levels": _quantized_levels(n)}


def _quantized_levels(n: int) -> dict:
    """With qgZ and qwZ, what the telemetry counts across: each cross piece's int8 values and scales."""
    from zerorun.runtime.comm.collectives import Collectives

    comm = Collectives(cpu="auto", quantized_gradients=True, quantized_weights=True)
    comm.reduce_scatter(torch.randn(n), torch.empty(n // 4)).wait()
    comm.all_gather(torch.randn(n), compute_copy=True).wait()
    return {kind: (entry["node_bytes"], entry["network_bytes"]) for kind, entry in comm.stats.as_dict().items()}


def test_reduce_scatter_sums_every_rank_and_all_gather_fills_every_piece_with_half_the_bytes_across() -> None:
    for rank, out in enumerate(run_ranks(_collectives, 4)):
        assert out["rs_error"] < 1e-5, (rank, out["rs_error"])
        assert out["gathered"], rank
        nbytes = 4 * 3001 * 4
        # all of the buffer within the node, one local rank's share (a half) across
        assert out["levels"]["reduce_scatter"] == (nbytes, nbytes // 2), out["levels"]
        assert out["levels"]["all_gather"] == (nbytes, nbytes // 2), out["levels"]
        assert out["transport"] == "shared memory within the node, gloo across", out["transport"]
        across = 2 * (3001 + 4 * 2)  # the half that crosses, in 2 pieces of 3001 int8 values and 2 scales each
        assert out["quantized_levels"] == {"reduce_scatter": (nbytes, across), "all_gather": (nbytes, across)}


@pytest.mark.slow
def test_stages_1_to_3_match_ddp_through_the_hierarchy_on_2_nodes_of_2_ranks() -> None:
    """Accumulation, clipping and qgZ's exactness within the node: the sums are node first, then across."""
    cases = [(1, 2, None), (2, 2, 0.05), (3, 2, None)]
    results = run_ranks(_as_nodes, 4, (_compare, cases))
    assert results == [[], [], [], []], results
