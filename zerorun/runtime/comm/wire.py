"""Which primitive each collective travels by, per (backend, device): the one table `Collectives` routes by.

Backends carry different things. NCCL moves device memory only. Gloo stages CUDA tensors through
pinned host memory inside its collectives (all-reduce, broadcast, all-gather, reduce-scatter), but its
point-to-point calls hand the tensor's pointer straight to a socket: a CUDA tensor there dies in
gloo's `writev` ("Bad address"), which is how the pairwise collectives once broke every multi-rank
CUDA run over gloo while every CPU test passed. So the choice is data, checked twice:

- `tests/runtime/test_wire.py` holds every route against `CARRIES` (what each backend accepts, per
  primitive and device, read from ProcessGroupGloo.cpp / ProcessGroupNCCL.cpp), and on a GPU machine
  (`zerorun bench gpu`) against the real backends;
- `tests/runtime/test_cuda_standin.py` trains every stage on CPU ranks that believe they hold CUDA
  tensors, through a process-group stand-in that refuses what `CARRIES` says the real one refuses.

| collective     | gloo, host memory          | gloo, CUDA memory                         | nccl, CUDA memory       |
|----------------|----------------------------|-------------------------------------------|-------------------------|
| all-reduce     | all_reduce                 | staged to host, then all_reduce           | all_reduce              |
| broadcast      | broadcast                  | staged to host, then broadcast            | broadcast               |
| reduce-scatter | point to point (pairwise)  | staged to host, then point to point       | reduce_scatter_tensor   |
| all-gather     | point to point (pairwise)  | staged to host, then point to point       | all_gather_into_tensor  |
| exchange       | point to point (pairwise)  | staged to host, then point to point       | all_to_all_single       |

The exchange (a distinct piece to every rank) is the wire of the quantized reduce-scatter (qgZ); the
quantized all-gather (qwZ) moves its int8 pieces by the all-gather's route. So each ZeRO++ collective
is one algorithm (quantize, move, dequantize and sum in rank order) over two wires.

A route "staged to host" copies the operands into pinned host memory, runs the host route there, and
copies the result back: everything host memory has (shared memory on one node, the hierarchy, int8
on the wire) then works for CUDA ranks on gloo too, with the host's very arithmetic (the same bits as
CPU ranks). Gloo would stage its own CUDA all-reduce and broadcast the same way, through its TCP
transport; ours take shared memory where the ranks share a host. On host memory, shared memory
(`zero.cpu_collectives`) and the two-level hierarchy replace the backend's primitive where they apply;
they use no backend primitive on the data (the hierarchy's levels route by this table again).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from zerorun.errors import ZerorunError


class Op(Enum):
    """The collectives zerorun issues on data (`Collectives`' public methods)."""

    ALL_REDUCE = "all-reduce"
    BROADCAST = "broadcast"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"
    EXCHANGE = "exchange"  # a distinct piece to every rank: the quantized reduce-scatter's wire


class Primitive(Enum):
    """A backend call that moves data; the value is `torch.distributed`'s name for it."""

    ALL_REDUCE = "all_reduce"
    BROADCAST = "broadcast"
    REDUCE_SCATTER_TENSOR = "reduce_scatter_tensor"
    ALL_GATHER_INTO_TENSOR = "all_gather_into_tensor"
    POINT_TO_POINT = "isend/irecv"
    ALL_TO_ALL = "all_to_all_single"


@dataclass(frozen=True)
class Route:
    """How one collective travels: the backend primitive, on the operands or on host copies of them."""

    primitive: Primitive
    staged: bool = False  # operands copied to (pinned) host memory first, the result copied back


# What each backend accepts, per primitive: the device types of the tensors it moves.
CARRIES: dict[str, dict[Primitive, frozenset[str]]] = {
    "gloo": {
        Primitive.ALL_REDUCE: frozenset({"cpu", "cuda"}),
        Primitive.BROADCAST: frozenset({"cpu", "cuda"}),
        Primitive.REDUCE_SCATTER_TENSOR: frozenset({"cpu", "cuda"}),
        Primitive.ALL_GATHER_INTO_TENSOR: frozenset({"cpu", "cuda"}),
        Primitive.ALL_TO_ALL: frozenset({"cpu", "cuda"}),
        Primitive.POINT_TO_POINT: frozenset({"cpu"}),  # last: a refused send can leave the pair's connection broken
    },
    "nccl": {primitive: frozenset({"cuda"}) for primitive in Primitive},
}

_HOST = {Op.ALL_REDUCE: Route(Primitive.ALL_REDUCE), Op.BROADCAST: Route(Primitive.BROADCAST),
         Op.REDUCE_SCATTER: Route(Primitive.POINT_TO_POINT), Op.ALL_GATHER: Route(Primitive.POINT_TO_POINT),
         Op.EXCHANGE: Route(Primitive.POINT_TO_POINT)}

ROUTES: dict[tuple[str, str], dict[Op, Route]] = {
    ("gloo", "cpu"): _HOST,
    ("gloo", "cuda"): {op: Route(way.primitive, staged=True) for op, way in _HOST.items()},
    ("nccl", "cuda"): {Op.ALL_REDUCE: Route(Primitive.ALL_REDUCE), Op.BROADCAST: Route(Primitive.BROADCAST),
                       Op.REDUCE_SCATTER: Route(Primitive.REDUCE_SCATTER_TENSOR),
                       Op.ALL_GATHER: Route(Primitive.ALL_GATHER_INTO_TENSOR),
                       Op.EXCHANGE: Route(Primitive.ALL_TO_ALL)},
}


def route(op: Op, backend: str, device_type: str) -> Route:
    """The route of `op` for tensors on `device_type` over `backend`; refused where no route exists."""
    routes = ROUTES.get((backend, device_type))
    if routes is None:
        raise ZerorunError(f"zerorun has no route for a {op.value} of {device_type} tensors over {backend} "
                           f"(routes: {', '.join(f'{b}/{d}' for b, d in ROUTES)}). This is a zerorun bug where "
                           f"the backend was chosen by zerorun (launch.backend: auto); else choose auto.")
    return routes[op]
