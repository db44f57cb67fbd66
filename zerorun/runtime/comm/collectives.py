"""The collectives zerorun uses, on flat buffers, chosen per backend by measurement.

Hooks and the optimizer decide *when* to communicate; this module decides *how*. Every call can
run asynchronously and returns a `Handle`; finishing work that must follow the transfer (copying
a reduced piece out of a bucket) is attached to the handle and runs in `wait()`.

Which backend primitive each collective uses, per (backend, device), is one table (wire.py). On gloo
the reduce-scatter and the all-gather go pairwise, point to point: gloo's reduce-scatter runs as a full
all-reduce plus a copy, and so would an all-reduce that keeps one piece: either sends every byte
twice, which is what costs over a real link (`zerorun bench comm --cluster 2x1`). Pairwise, each rank
sends every other rank that rank's piece and adds what it receives, so each byte crosses the network
once ((n-1)/n of the buffer per rank). The all-gather is pairwise too: one broadcast per owner also
sends each byte once, but its broadcasts queue behind one another on gloo's worker threads and left a
link partly idle (`zerorun bench comm --cluster 2x1`). Gloo's point-to-point carries host memory only,
so CUDA tensors on gloo (ranks sharing a GPU: `launch.backend: gloo`) go through pinned host copies.

CPU ranks that all share one host skip gloo's TCP loopback altogether (`zero.cpu_collectives`,
default auto): every operation goes through a shared-memory segment (shm_collectives.py), at
memory speed, on a worker thread of its own; the handle waits for it.

Where the world spans several nodes of several ranks each, reduce-scatters and all-gathers of the
world group are hierarchical (hier_collectives.py): within the node first, across nodes only each
local rank's share.

Every collective is checked against its peers' before its payload moves (places.py, tags.py): ranks that reached
different collectives stop with one message naming where each was, never exchange the wrong data.

Byte and call counts are kept per kind of collective, and per level (within the node, across).
Time is measured from launch to the end of `wait()` on the host, so accounting never adds a
synchronisation of its own.
"""

from __future__ import annotations

import logging
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist

from zerorun import ops
from zerorun.runtime import context
from zerorun.runtime.comm import compression
from zerorun.runtime.comm.handles import CommStats, FutureWork, Handle, Pending  # noqa: F401 - Pending too
from zerorun.runtime.comm.hier_collectives import Hierarchical, local_world_for
from zerorun.runtime.comm.pairwise import PointToPoint, make_lanes, store_into
from zerorun.runtime.comm.places import Tag
from zerorun.runtime.comm.quantize import Quantized
from zerorun.runtime.comm.shm_collectives import (
    CpuCollectives,
    Segments,
    ShmCollectives,
    host_contiguous,
    shared_memory,
)
from zerorun.runtime.comm.tags import TagCheck
from zerorun.runtime.comm.wire import Op, Primitive, route

log = logging.getLogger("zerorun")
Quantization = Literal["auto", True, False]


class Collectives(PointToPoint):
    """Collectives over one process group (the data-parallel group)."""

    def __init__(self, group: dist.ProcessGroup | None = None, cpu: CpuCollectives = "gloo",
                 timeout_s: float = 300.0, quantized_gradients: Quantization = False,
                 quantized_weights: Quantization = False, device: torch.device | None = None,
                 tags: TagCheck | None = None, tagged: bool = True, runtime: context.Runtime | None = None) -> None:
        """`quantized_*`: True, False or "auto" (compression.py: measured here, at setup, on `device`). `tags`: share
        another group's numbering and check (hpZ's node groups: every rank issues them at the same place); `tagged`:
        False for a hierarchy's levels, whose world-level collective was checked. `runtime`: where the group's
        shared-memory segment is kept (runtime/context.py; None: this thread's)."""
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.stats = CommStats()
        self._cpu, self._timeout_s = cpu, timeout_s
        self.runtime = runtime or context.current()
        self.shm = shared_memory(group, self.rank, self.world_size, self.backend, cpu, timeout_s,
                                 self.runtime.part(Segments))
        # the tags' own gloo group wherever they cross a wire (tags.py); shared memory carries them in its header
        # (every rank decides `shm` alike: shm_collectives.py)
        own = self.backend != "gloo" or self.shm is None
        self.tags = (tags or TagCheck(group, self.rank, self.world_size, own, timeout_s)) if tagged else None
        # the payload's own lanes where it crosses gloo's TCP point to point (pairwise.py: why); only for the world's
        # group, which every rank builds at the same point (a group of some ranks is built by those alone)
        if group is None and self.backend == "gloo" and self.shm is None and self.world_size > 1:
            self.lanes = make_lanes(timeout_s)
        self.transport = "shared memory" if self.shm else self.backend
        self.stats.level = "node" if self.shm else "network"
        self.quantized_gradients = quantized_gradients is True  # reduce-scatters over the network send block int8
        self.quantized_weights = quantized_weights is True  # so do all-gathers of compute copies (stage 3, stages 1/2)
        local = local_world_for(self.world_size) if group is None else None
        self.hier = Hierarchical(self._level, self.rank, self.world_size, local) if local else None
        if self.hier is not None:
            self.transport = f"{self.hier.node.transport} within the node, {self.hier.cross.transport} across"
        if "auto" in (quantized_gradients, quantized_weights):
            self._decide_compression(quantized_gradients == "auto", quantized_weights == "auto", device)
        if self.quantized_gradients or self.quantized_weights:
            ops.prepare("quantize")  # built (or its fallback announced) at setup, not inside the first backward
            if torch.cuda.is_available():
                ops.prepare("quantize_cuda")

    def _decide_compression(self, gradients: bool, weights: bool, device: torch.device | None) -> None:
        """`auto` (compression.py): int8 on the level that crosses the network where the measured link and codec
        rates say it pays; rank 0 says which, and why, once."""
        network = self.hier.cross if self.hier is not None else self
        keys = " and ".join(k for k, on in (("quantized_gradients", gradients), ("quantized_weights", weights)) if on)
        if self.hier is None and self.shm is not None:
            on, why = False, "every collective goes through shared memory on this host: nothing crosses a network"
        else:
            rates = compression.measure(network, device or torch.device("cpu"))
            on, why = rates.pays, rates.describe()
        for level in [self] if network is self else [self, network]:
            level.quantized_gradients = level.quantized_gradients or (gradients and on)
            level.quantized_weights = level.quantized_weights or (weights and on)
        if self.rank == 0:
            log.warning("zerorun: zero.%s: auto: %s: %s.", keys, "on" if on else "off", why)

    def _level(self, group: dist.ProcessGroup, node_level: bool) -> Collectives:
        """One level's collectives for `Hierarchical`: the node's shared memory where it can, else the backend;
        across nodes, the backend with this group's quantization."""
        return Collectives(group, cpu=self._cpu if node_level else "gloo", timeout_s=self._timeout_s,
                           quantized_gradients=self.quantized_gradients and not node_level,
                           quantized_weights=self.quantized_weights and not node_level, tagged=False,
                           runtime=self.runtime)

    def _hierarchical(self, *tensors: torch.Tensor) -> bool:
        return self.hier is not None and all(t.is_contiguous() for t in tensors)

    def _int8(self, kind: str, full: torch.Tensor, compute_copy: bool = False) -> bool:
        """Whether this collective crosses the network as block int8: a reduce-scatter with qgZ, an all-gather of
        a compute copy with qwZ, of floating-point data (on either backend: only the wire differs)."""
        wanted = self.quantized_gradients if kind == "reduce_scatter" else compute_copy and self.quantized_weights
        return wanted and full.is_floating_point()

    def _record_levels(self, kind: str, full: torch.Tensor, quantized: bool) -> None:
        """A hierarchical collective: all of `full` moves within the node, one local rank's share across (as block
        int8 where `quantized`: the level counts what crossed)."""
        assert self.hier is not None
        nbytes = full.numel() * full.element_size()
        self.stats.by_level[kind]["node"] += nbytes
        share = full.numel() // self.hier.local  # split in pieces among the nodes, each quantized on its own
        nodes = self.world_size // self.hier.local
        self.stats.by_level[kind]["network"] += (nodes * Quantized.wire_bytes(share // nodes) if quantized
                                                 else nbytes // self.hier.local)

    def _record_quantized(self, kind: str, full: torch.Tensor) -> None:
        """A flat collective that travels as block int8: its level counts the int8 values and scales, not
        `full`'s bytes (which `_record` counted), so the telemetry says what crossed."""
        exact = full.numel() * full.element_size()
        quantized = self.world_size * Quantized.wire_bytes(full.numel() // self.world_size)  # each piece its blocks
        self.stats.by_level[kind][self.stats.level] -= exact - quantized

    def _on_shm(self, *tensors: torch.Tensor) -> ShmCollectives | None:
        """The shared-memory transport, where it carries these tensors (contiguous, on the CPU)."""
        if self.shm is not None and host_contiguous(tensors):
            return self.shm
        return None

    def _shm_handle(self, kind: str, shm: ShmCollectives, operation: Callable[..., None], tag: Tag | None,
                    *args: object) -> Handle:
        names = self.tags.places.names if self.tags is not None else None
        return Handle([FutureWork(shm.submit(operation, *args, tag=tag, names=names))], None, self.stats, kind)

    def _tag_for(self, op: Op, tensor: torch.Tensor, unit: int, detail: int = 0) -> Tag | None:
        """The tag of a collective about to be issued (None: untagged, a hierarchy's level, or a world of one)."""
        if self.tags is None or self.world_size == 1:
            return None
        return self.tags.next(op, tensor.numel(), unit, detail)

    def _agreed(self, tag: Tag | None) -> None:
        """Return once every rank issued this collective (the wire's check); raise `DesyncError` otherwise."""
        if tag is not None:
            assert self.tags is not None
            self.tags.on_wire(tag)

    def end_of_script(self) -> None:
        """The worker's last meeting, after the script returned: a rank still training meets it as a mismatch (its
        peers' scripts ended early, e.g. a data loader ran out) and stops with that message instead of waiting."""
        if self.tags is None or self.world_size == 1:
            return
        tag = self.tags.end()
        shm = self.shm
        if shm is not None:
            self._shm_handle("barrier", shm, shm.barrier, tag).wait()
        else:
            self._agreed(tag)

    def _trimmed(self, kind: str, full: torch.Tensor, used: Sequence[int] | None) -> None:
        """A flat collective that moves only the `used` start of each rank's piece: its counts say so (`_record`
        counted all of `full`)."""
        if used is not None:
            unmoved = (full.numel() - sum(used)) * full.element_size()
            self.stats.bytes[kind] -= unmoved
            self.stats.by_level[kind][self.stats.level] -= unmoved

    def _record(self, kind: str, tensor: torch.Tensor, flat: bool = True) -> None:
        self.stats.calls[kind] += 1
        self.stats.bytes[kind] += tensor.numel() * tensor.element_size()
        if flat:
            self.stats.by_level[kind][self.stats.level] += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = True, unit: int = -1) -> Handle:
        """Sum (or `op`) `tensor` across ranks, in place; `unit`: the unit it serves (named if ranks disagree)."""
        return self._all_reduce(tensor, op, async_op, self._tag_for(Op.ALL_REDUCE, tensor, unit, op.value))

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, async_op: bool,
                    tag: Tag | None) -> Handle:
        if route(Op.ALL_REDUCE, self.backend, tensor.device.type).staged:
            host = _to_host(tensor)
            return self._all_reduce(host, op, async_op, tag).followed_by(lambda: tensor.copy_(host, non_blocking=True))
        self._record("all_reduce", tensor)
        shm = self._on_shm(tensor)
        if shm is not None and shm.handles(op):
            return self._shm_handle("all_reduce", shm, shm.all_reduce, tag, tensor, op)
        self._agreed(tag)
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        return Handle([work], None, self.stats, "all_reduce")

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool = False, unit: int = -1,
                       used: Sequence[int] | None = None) -> Handle:
        """Sum `full` across ranks; this rank's equal-sized piece goes into `out` (or is added to it).

        `full` is consumed (its contents are undefined afterwards) and must stay alive until `wait()`. `used`: per
        rank, the elements at the start of its piece that carry values, the rest being zeros on every rank (a whole
        layout's padding, partition.py); the point-to-point and shared-memory wires move only those, and `out`'s
        rest is zero (or left as it is, accumulating).
        """
        assert full.numel() == out.numel() * self.world_size, "reduce_scatter: full must be world_size x out"
        if self.world_size == 1:
            self._record("reduce_scatter", full)
            return Handle([], lambda: store_into(out, full, accumulate), self.stats, "reduce_scatter")
        tag = self._tag_for(Op.REDUCE_SCATTER, full, unit)
        if route(Op.REDUCE_SCATTER, self.backend, full.device.type).staged:
            host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=torch.cuda.is_available())
            handle = self._reduce_scatter_on_wire(_to_host(full), host_out, False, tag, used)
            return handle.followed_by(lambda: store_into(out, host_out.to(out.device, non_blocking=True), accumulate))
        return self._reduce_scatter_on_wire(full, out, accumulate, tag, used)

    def _reduce_scatter_on_wire(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool,
                                tag: Tag | None, used: Sequence[int] | None = None) -> Handle:
        """A reduce-scatter of tensors where the backend's wire reads them: hierarchical across nodes of several
        ranks, else through shared memory on one host, else as block int8 (qgZ), else the wire's own."""
        hierarchical = self._hierarchical(full, out)
        self._record("reduce_scatter", full, flat=not hierarchical)
        if hierarchical:
            self._record_levels("reduce_scatter", full, self._int8("reduce_scatter", full))
            assert self.hier is not None
            self._agreed(tag)
            return Handle([self.hier.reduce_scatter(full, out, accumulate)], None, self.stats, "reduce_scatter")
        shm = self._on_shm(full, out)
        if shm is not None:
            self._trimmed("reduce_scatter", full, used)
            return self._shm_handle("reduce_scatter", shm, shm.reduce_scatter, tag, full, out, accumulate, used)
        self._agreed(tag)
        if self._int8("reduce_scatter", full):
            self._record_quantized("reduce_scatter", full)
            return self._quantized_reduce_scatter(full, out, accumulate)
        if route(Op.REDUCE_SCATTER, self.backend, full.device.type).primitive is Primitive.POINT_TO_POINT:
            self._trimmed("reduce_scatter", full, used)
            return self._pairwise_reduce_scatter(full, out, accumulate, used)
        target = torch.empty_like(out) if accumulate else out
        work = dist.reduce_scatter_tensor(target, full, group=self.group, async_op=True)
        then = (lambda: out.add_(target)) if accumulate else None
        return Handle([work], then, self.stats, "reduce_scatter")

    def all_gather(self, full: torch.Tensor, compute_copy: bool = False, unit: int = -1,
                   used: Sequence[int] | None = None) -> Handle:
        """Fill `full` from every rank's piece; this rank's piece is already in place in `full`.

        `compute_copy`: `full` is only computed with, never stored back (stage 3's gathered unit; stages 1/2's flat
        parameters when their master is kept apart), so with `quantized_weights` it may travel as block int8
        (qwZ); every rank's piece, this one's included, then holds the dequantized values, so all ranks compute
        with the same weights."""
        if self.world_size == 1:
            self._record("all_gather", full)
            return Handle([], None, self.stats, "all_gather")
        tag = self._tag_for(Op.ALL_GATHER, full, unit)
        if route(Op.ALL_GATHER, self.backend, full.device.type).staged:
            host = torch.empty(full.shape, dtype=full.dtype, pin_memory=torch.cuda.is_available())
            own = slice(self.rank * (full.numel() // self.world_size), (self.rank + 1) * (full.numel() // self.world_size))
            host.view(-1)[own].copy_(full.view(-1)[own])  # waits for the device's work on it, as any device-to-host copy
            handle = self._all_gather_on_wire(host, compute_copy, tag, used)
            return handle.followed_by(lambda: full.copy_(host, non_blocking=True))
        return self._all_gather_on_wire(full, compute_copy, tag, used)

    def _all_gather_on_wire(self, full: torch.Tensor, compute_copy: bool, tag: Tag | None,
                            used: Sequence[int] | None = None) -> Handle:
        """An all-gather of a tensor where the backend's wire reads it: hierarchical, else shared memory, else as
        block int8 (qwZ), else the wire's own."""
        hierarchical = self._hierarchical(full)
        self._record("all_gather", full, flat=not hierarchical)
        if hierarchical:
            self._record_levels("all_gather", full, self._int8("all_gather", full, compute_copy))
            assert self.hier is not None
            self._agreed(tag)
            return Handle([self.hier.all_gather(full, compute_copy)], None, self.stats, "all_gather")
        shm = self._on_shm(full)
        if shm is not None:
            self._trimmed("all_gather", full, used)
            return self._shm_handle("all_gather", shm, shm.all_gather, tag, full, used)
        self._agreed(tag)
        pieces = full.view(self.world_size, -1)
        if self._int8("all_gather", full, compute_copy):
            self._record_quantized("all_gather", full)
            return self._quantized_all_gather(full)
        if route(Op.ALL_GATHER, self.backend, full.device.type).primitive is Primitive.POINT_TO_POINT:
            self._trimmed("all_gather", full, used)
            n = used or [pieces.shape[1]] * self.world_size
            works = self._exchange(lambda peer: [pieces[self.rank, :n[self.rank]]], lambda peer: [pieces[peer, :n[peer]]])
            return Handle(works, None, self.stats, "all_gather")
        work = dist.all_gather_into_tensor(full, pieces[self.rank], group=self.group, async_op=True)
        return Handle([work], None, self.stats, "all_gather")

    def broadcast(self, tensor: torch.Tensor, src: int = 0, unit: int = -1) -> Handle:
        """Rank `src`'s `tensor` into every rank's."""
        return self._broadcast(tensor, src, self._tag_for(Op.BROADCAST, tensor, unit, src))

    def _broadcast(self, tensor: torch.Tensor, src: int, tag: Tag | None) -> Handle:
        if route(Op.BROADCAST, self.backend, tensor.device.type).staged:
            host = _to_host(tensor)
            return self._broadcast(host, src, tag).followed_by(lambda: tensor.copy_(host, non_blocking=True))
        self._record("broadcast", tensor)
        shm = self._on_shm(tensor)
        if shm is not None and self.world_size > 1:
            return self._shm_handle("broadcast", shm, shm.broadcast, tag, tensor, src)
        self._agreed(tag)
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        return Handle([work], None, self.stats, "broadcast")


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory (pinned where CUDA exists); returns once the copy is complete, so the
    device's work that wrote `tensor` is complete too."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(tensor)
