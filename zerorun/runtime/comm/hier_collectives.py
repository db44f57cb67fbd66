"""Two-level collectives for nodes of several ranks: within the node first, across nodes only a share.

A flat reduce-scatter or all-gather among N nodes x L ranks sends each rank's pieces to every rank
of the other nodes: L times what must cross the link. Hierarchical, each byte crosses it once:

| operation      | within the node (shared memory)                    | across nodes (the link), among ranks of the same local rank |
|----------------|----------------------------------------------------|--------------------------------------------------------------|
| reduce-scatter | 1. reduce-scatter: local rank l gets the node's sum of the pieces of ranks n*L + l, every n | 2. reduce-scatter of that share: rank n*L + l keeps its piece |
| all-gather     | 2. all-gather of the shares                       | 1. all-gather of piece n*L + l among the ranks of local rank l |

Ranks are placed as launchers place them: node n holds ranks [n*L, (n+1)*L). Each level is a
`Collectives` of its own group, so it routes by the same table (wire.py) on either backend: the
node level through shared memory where the node allows (`zero.cpu_collectives`) or the backend (on
GPUs, NVLink: always exact), the cross level through the backend and, with qgZ/qwZ, as int8 on the
link only. Sums are taken node first, then across nodes in node order: the same bits on every rank,
a different rounding from the flat sum in rank order (`tests/runtime/test_hier_collectives.py`
holds both against DDP).

Host tensors (gloo): the two levels of one operation run in order on one worker thread, so every
rank issues the cross-node transfers in the order it issued the operations; the caller's thread
only waits. Device tensors (NCCL): the two levels are issued at once, in program order, on a side
stream that first waits for the caller's; a level's wait holds only that side stream, and the
caller's stream waits for it only when the caller waits (NCCL must see every rank issue its
collectives in one order: no second thread issues them).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from zerorun.runtime.comm.dist import joined
from zerorun.runtime.comm.handles import FutureWork


class _Waitable(Protocol):
    def wait(self) -> object: ...

    def is_completed(self) -> bool: ...


class LevelCollectives(Protocol):
    """What one level needs of `collectives.Collectives` (named here so that this module does not import it:
    collectives.py builds the levels and calls into this module)."""

    transport: str
    world_size: int
    quantized_gradients: bool  # int8 on this level's wire (`compression.py` may turn them on after setup)
    quantized_weights: bool

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> _Waitable: ...

    def all_gather(self, full: torch.Tensor, compute_copy: bool = False) -> _Waitable: ...

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = True) -> _Waitable: ...


def local_world_for(world_size: int) -> int | None:
    """Ranks per node where the world spans several nodes of several ranks each (the launcher's
    LOCAL_WORLD_SIZE); None where the collectives stay flat."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    if not 1 < local < world_size or world_size % local:
        return None
    return local


class Hierarchical:
    """Reduce-scatter and all-gather of the world group, node level first (see the module docstring)."""

    def __init__(self, make: Callable[[dist.ProcessGroup, bool], LevelCollectives], rank: int, world_size: int, local: int) -> None:
        """`make(group, node_level)` builds the `Collectives` of one level's group."""
        self.local, self.nodes = local, world_size // local
        self.node_index, self.local_rank = divmod(rank, local)
        node_groups = [dist.new_group(list(range(n * local, (n + 1) * local))) for n in range(self.nodes)]
        cross_groups = [dist.new_group([n * local + q for n in range(self.nodes)]) for q in range(local)]
        self.node = make(joined(node_groups[self.node_index]), True)
        self.cross = make(joined(cross_groups[self.local_rank]), False)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerorun-hier")
        self._stream: torch.cuda.Stream | None = None  # device tensors: the levels' side stream, made at first use

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool) -> _Waitable:
        """The world's sum of `full`; this rank's piece into `out` (or added to it)."""
        staged = full.view(self.nodes, self.local, -1).transpose(0, 1).contiguous()  # [local rank][node][piece]
        return self._start(self._reduce_scatter, staged, out, accumulate)

    def _reduce_scatter(self, staged: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        share = torch.empty(staged.shape[1:], dtype=staged.dtype, device=staged.device).view(-1)  # node's sum
        self.node.reduce_scatter(staged.view(-1), share).wait()
        self.cross.reduce_scatter(share, out, accumulate=accumulate).wait()

    def all_gather(self, full: torch.Tensor, compute_copy: bool) -> _Waitable:
        """Every rank's piece of `full` (its own in place) into `full`."""
        return self._start(self._all_gather, full, compute_copy)

    def _all_gather(self, full: torch.Tensor, compute_copy: bool) -> None:
        grid = full.view(self.nodes, self.local, -1)
        staged = torch.empty((self.local, self.nodes, grid.shape[2]), dtype=full.dtype, device=full.device)
        share = staged[self.local_rank]
        share[self.node_index].copy_(grid[self.node_index, self.local_rank])
        self.cross.all_gather(share.view(-1), compute_copy=compute_copy).wait()
        self.node.all_gather(staged.view(-1)).wait()
        grid.copy_(staged.transpose(0, 1))

    def _start(self, levels: Callable[..., None], first: torch.Tensor, *args: object) -> _Waitable:
        """Run `levels` where the tensors' device orders them (module docstring)."""
        if first.device.type == "cpu":
            return FutureWork(self._worker.submit(levels, first, *args))
        if self._stream is None:
            self._stream = torch.cuda.Stream(first.device)
        self._stream.wait_stream(torch.cuda.current_stream(first.device))  # the inputs are written
        with torch.cuda.stream(self._stream):
            levels(first, *args)
            done = torch.cuda.Event()
            done.record(self._stream)
        return _EventWork(done, first.device)


class _EventWork:
    """Levels queued on the side stream: waiting makes the caller's stream wait for them, not the host."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def is_completed(self) -> bool:
        return bool(self.event.query())
