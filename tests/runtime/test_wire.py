"""The routing table (wire.py): every route is one its backend carries, and the table matches real backends.

The pure tests run everywhere. The last one needs a GPU (`zerorun bench gpu` runs it): two ranks share
the GPU over gloo and try every primitive on CUDA tensors, and one rank on NCCL tries host tensors; what
`CARRIES` says a backend refuses must fail, and what it says it carries must deliver the right values.
So the table the CPU stand-in enforces (tests/runtime/cuda_standin.py) is itself checked against the
backends it stands in for.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import run_ranks
from zerorun.errors import ZerorunError
from zerorun.runtime.comm.wire import CARRIES, ROUTES, Op, Primitive, route

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: runs on a GPU machine")


def test_every_backend_and_device_has_a_route_for_every_collective() -> None:
    assert set(ROUTES) == {("gloo", "cpu"), ("gloo", "cuda"), ("nccl", "cuda")}
    for routes in ROUTES.values():
        assert set(routes) == set(Op)


@pytest.mark.parametrize("backend, device", sorted(ROUTES))
def test_every_route_is_carried_by_its_backend(backend: str, device: str) -> None:
    for op, way in ROUTES[(backend, device)].items():
        moved = "cpu" if way.staged else device  # a staged route moves host copies
        assert moved in CARRIES[backend][way.primitive], f"{op.value} on {backend}/{device}: {way}"


def test_cuda_tensors_never_go_point_to_point_over_gloo() -> None:
    """The regression this table exists for: gloo's send/recv on a CUDA pointer ("writev ... Bad address")."""
    for op in Op:
        way = route(op, "gloo", "cuda")
        assert way.staged or "cuda" in CARRIES["gloo"][way.primitive]
    assert "cuda" not in CARRIES["gloo"][Primitive.POINT_TO_POINT]


def test_host_tensors_on_nccl_are_refused_with_a_reason() -> None:
    with pytest.raises(ZerorunError, match="no route for a reduce-scatter of cpu tensors over nccl"):
        route(Op.REDUCE_SCATTER, "nccl", "cpu")


def _try(primitive: Primitive, rank: int, world: int, device: str) -> str:
    """Run `primitive` on tensors on `device`: "ok" with the right values, else the error's first line."""
    import torch.distributed as dist

    x = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    try:
        if primitive is Primitive.ALL_REDUCE:
            dist.all_reduce(x)
            expected = sum(torch.arange(4.0) + 10 * r for r in range(world))
        elif primitive is Primitive.BROADCAST:
            dist.broadcast(x, src=0)
            expected = torch.arange(4.0)
        elif primitive is Primitive.ALL_GATHER_INTO_TENSOR:
            out = torch.empty(4 * world, device=device)
            dist.all_gather_into_tensor(out, x)
            x, expected = out, torch.cat([torch.arange(4.0) + 10 * r for r in range(world)])
        elif primitive is Primitive.REDUCE_SCATTER_TENSOR:
            full = torch.arange(4.0 * world, device=device) + rank
            x = torch.empty(4, device=device)
            dist.reduce_scatter_tensor(x, full)
            expected = sum(torch.arange(4.0 * world) + r for r in range(world))[4 * rank:4 * rank + 4]
        elif primitive is Primitive.ALL_TO_ALL:
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x)
            x, expected = out, torch.cat([(torch.arange(4.0) + 10 * r).view(world, -1)[rank] for r in range(world)])
        else:  # point to point, both directions at once
            got = torch.empty_like(x)
            peer = 1 - rank if world == 2 else rank
            receive = dist.irecv(got, src=peer)
            dist.isend(x, dst=peer).wait()  # first: a refused send raises here, where the receive would wait on
            receive.wait()
            x, expected = got, torch.arange(4.0) + 10 * peer
        if device == "cuda":
            torch.cuda.synchronize()
        return "ok" if torch.equal(x.cpu(), expected) else f"wrong values {x.cpu().tolist()}"
    except Exception as err:  # noqa: BLE001 - the backend's refusal is the result
        return f"refused: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"  # some have no text


def _carried(rank: int, world: int, backend: str, device: str) -> dict[str, str]:
    import os

    from zerorun.runtime.comm.dist import init_distributed

    os.environ["ZERORUN_BACKEND"] = backend
    init_distributed()
    return {primitive.name: _try(primitive, rank, world, device) for primitive in CARRIES[backend]
            if not (primitive is Primitive.POINT_TO_POINT and (world == 1 or (backend, device) == ("gloo", "cuda")))}


@needs_gpu
@pytest.mark.parametrize("backend, device, world", [("gloo", "cuda", 2), ("nccl", "cpu", 1), ("nccl", "cuda", 1)])
def test_carries_matches_the_real_backends(backend: str, device: str, world: int) -> None:
    results = run_ranks(_carried, world, (backend, device), timeout=180)
    wrong = []
    for rank, outcomes in enumerate(results):
        for name, outcome in outcomes.items():
            carried = device in CARRIES[backend][Primitive[name]]
            if carried != (outcome == "ok"):
                wrong.append(f"rank {rank}: {backend} {name} on {device}: table says "
                             f"{'carried' if carried else 'refused'}, the backend: {outcome}")
    assert not wrong, "\n".join(wrong)


def _point_to_point(rank: int, world: int) -> str:
    import os

    from zerorun.runtime.comm.dist import init_distributed

    os.environ["ZERORUN_BACKEND"] = "gloo"
    init_distributed()
    return _try(Primitive.POINT_TO_POINT, rank, world, "cuda")


@needs_gpu
def test_gloo_refuses_cuda_tensors_point_to_point_as_the_table_says() -> None:
    """Gloo's transport thread writes the CUDA pointer to its socket ("writev ... Bad address") and throws there:
    on an H200 (torch 2.11) one rank ended in std::terminate and the other's next call raised. So this case runs in
    ranks of its own, and a rank that dies is the refusal; both delivering the values would contradict `CARRIES`."""
    from zerorun.bench.spawn import RankFailure
    from zerorun.bench.spawn import run_ranks as run_ranks_raising

    assert "cuda" not in CARRIES["gloo"][Primitive.POINT_TO_POINT]
    try:
        outcomes = run_ranks_raising(_point_to_point, 2, (), timeout=120)
    except RankFailure as failure:
        assert "Bad address" in str(failure) or "died" in str(failure), failure
        return
    assert "ok" not in outcomes, outcomes
