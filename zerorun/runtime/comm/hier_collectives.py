"""Two-level collectives for nodes of several ranks: within the node first, across nodes only a share.

A flat reduce-scatter or all-gather among N nodes x L ranks sends each rank's pieces to every rank
of the other nodes: L times what must cross the link. Hierarchical, each byte crosses it once:

| operation      | within the node (shared memory)                    | across nodes (the link), among ranks of the same local rank |
|----------------|----------------------------------------------------|--------------------------------------------------------------|
| reduce-scatter | 1. reduce-scatter: local rank l gets the node's sum of the pieces of ranks n*L + l, every n | 2. reduce-scatter of that share: rank n*L + l keeps its piece |
| all-gather     | 2. all-gather of the shares                       | 1. all-gather of piece n*L + l among the ranks of local rank l |

Ranks are placed as launchers place them: node n holds ranks [n*L, (n+1)*L). The node level uses
shared memory where the node allows (`zero.cpu_collectives`), the cross level the backend with
zerorun's pairwise reduce-scatter and, with qgZ/qwZ, int8 on the link only. Sums are taken node
first, then across nodes in node order: the same bits on every rank, a different rounding from the
flat sum in rank order (`tests/runtime/test_hier_collectives.py` holds both against DDP).

The two levels of one operation run in order on one worker thread, so every rank issues the
cross-node transfers in the order it issued the operations; the caller's thread only waits.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol

import torch
import torch.distributed as dist


class _Waitable(Protocol):
    def wait(self) -> object: ...


class LevelCollectives(Protocol):
    """What one level needs of `collectives.Collectives` (named here so that this module does not import it:
    collectives.py builds the levels and calls into this module)."""

    transport: str

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> _Waitable: ...

    def all_gather(self, full: torch.Tensor, compute_copy: bool = False) -> _Waitable: ...


def local_world_for(world_size: int, backend: str) -> int | None:
    """Ranks per node where the world spans several nodes of several ranks each (the launcher's
    LOCAL_WORLD_SIZE), on CPU ranks (gloo); None where the collectives stay flat."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    if backend != "gloo" or not 1 < local < world_size or world_size % local:
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
        self.node = make(node_groups[self.node_index], True)
        self.cross = make(cross_groups[self.local_rank], False)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerorun-hier")

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool) -> Future:
        """The world's sum of `full`; this rank's piece into `out` (or added to it)."""
        staged = full.view(self.nodes, self.local, -1).transpose(0, 1).contiguous()  # [local rank][node][piece]
        return self._worker.submit(self._reduce_scatter, staged, out, accumulate)

    def _reduce_scatter(self, staged: torch.Tensor, out: torch.Tensor, accumulate: bool) -> None:
        share = torch.empty(staged.shape[1:], dtype=staged.dtype).view(-1)  # the node's sum, pieces n*L + l
        self.node.reduce_scatter(staged.view(-1), share).wait()
        self.cross.reduce_scatter(share, out, accumulate=accumulate).wait()

    def all_gather(self, full: torch.Tensor, compute_copy: bool) -> Future:
        """Every rank's piece of `full` (its own in place) into `full`."""
        return self._worker.submit(self._all_gather, full, compute_copy)

    def _all_gather(self, full: torch.Tensor, compute_copy: bool) -> None:
        grid = full.view(self.nodes, self.local, -1)
        staged = torch.empty((self.local, self.nodes, grid.shape[2]), dtype=full.dtype)
        share = staged[self.local_rank]
        share[self.node_index].copy_(grid[self.node_index, self.local_rank])
        self.cross.all_gather(share.view(-1), compute_copy=compute_copy).wait()
        self.node.all_gather(staged.view(-1)).wait()
        grid.copy_(staged.transpose(0, 1))
