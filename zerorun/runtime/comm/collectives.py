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

Byte and call counts are kept per kind of collective, and per level (within the node, across).
Time is measured from launch to the end of `wait()` on the host, so accounting never adds a
synchronisation of its own.
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Literal, Sequence

import torch
import torch.distributed as dist

from zerorun import ops
from zerorun.runtime.comm import compression
from zerorun.runtime.comm.handles import CommStats, FutureWork, Handle, Pending  # noqa: F401 - Pending too
from zerorun.runtime.comm.hier_collectives import Hierarchical, local_world_for
from zerorun.runtime.comm.quantize import BLOCK, Quantized, QuantizedRows, dequantize_add, dequantize_into, quantize
from zerorun.runtime.comm.shm_collectives import CpuCollectives, ShmCollectives, host_contiguous, shared_memory
from zerorun.runtime.comm.wire import Op, Primitive, route

log = logging.getLogger("zerorun")
Quantization = Literal["auto", True, False]
CODEC_CHUNK = 256 * BLOCK  # elements quantized at once on the point-to-point wire: 2 MiB of fp32, 0.5 MiB sent
Span = Callable[[int, int], None]  # work on elements [lo, hi) of every row


class Collectives:
    """Collectives over one process group (the data-parallel group)."""

    def __init__(self, group: dist.ProcessGroup | None = None, cpu: CpuCollectives = "gloo",
                 timeout_s: float = 300.0, quantized_gradients: Quantization = False,
                 quantized_weights: Quantization = False, device: torch.device | None = None) -> None:
        """`quantized_*`: True, False or "auto" (compression.py: measured here, at setup, on `device`)."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = dist.get_backend(group)
        self.stats = CommStats()
        self._cpu, self._timeout_s = cpu, timeout_s
        self.shm = shared_memory(group, self.rank, self.world_size, self.backend, cpu, timeout_s)
        self.transport = "shared memory" if self.shm else self.backend
        self.stats.level = "node" if self.shm else "network"
        self._tag = 0
        self._codec: ThreadPoolExecutor | None = None  # quantized point-to-point collectives: made at first use
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
                           quantized_weights=self.quantized_weights and not node_level)

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

    def _shm_handle(self, kind: str, shm: ShmCollectives, operation: Callable[..., None], *args: object) -> Handle:
        return Handle([FutureWork(shm.submit(operation, *args))], None, self.stats, kind)

    def _record(self, kind: str, tensor: torch.Tensor, flat: bool = True) -> None:
        self.stats.calls[kind] += 1
        self.stats.bytes[kind] += tensor.numel() * tensor.element_size()
        if flat:
            self.stats.by_level[kind][self.stats.level] += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = True) -> Handle:
        """Sum (or `op`) `tensor` across ranks, in place."""
        if route(Op.ALL_REDUCE, self.backend, tensor.device.type).staged:
            host = _to_host(tensor)
            return self.all_reduce(host, op, async_op).followed_by(lambda: tensor.copy_(host, non_blocking=True))
        self._record("all_reduce", tensor)
        shm = self._on_shm(tensor)
        if shm is not None and shm.handles(op):
            return self._shm_handle("all_reduce", shm, shm.all_reduce, tensor, op)
        work = dist.all_reduce(tensor, op=op, group=self.group, async_op=async_op)
        return Handle([work], None, self.stats, "all_reduce")

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> Handle:
        """Sum `full` across ranks; this rank's equal-sized piece goes into `out` (or is added to it).

        `full` is consumed (its contents are undefined afterwards) and must stay alive until `wait()`.
        """
        assert full.numel() == out.numel() * self.world_size, "reduce_scatter: full must be world_size x out"
        if self.world_size == 1:
            self._record("reduce_scatter", full)
            return Handle([], lambda: _store(out, full, accumulate), self.stats, "reduce_scatter")
        if route(Op.REDUCE_SCATTER, self.backend, full.device.type).staged:
            host_out = torch.empty(out.shape, dtype=out.dtype, pin_memory=torch.cuda.is_available())
            handle = self._reduce_scatter_on_wire(_to_host(full), host_out, accumulate=False)
            return handle.followed_by(lambda: _store(out, host_out.to(out.device, non_blocking=True), accumulate))
        return self._reduce_scatter_on_wire(full, out, accumulate)

    def _reduce_scatter_on_wire(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool) -> Handle:
        """A reduce-scatter of tensors where the backend's wire reads them: hierarchical across nodes of several
        ranks, else through shared memory on one host, else as block int8 (qgZ), else the wire's own."""
        hierarchical = self._hierarchical(full, out)
        self._record("reduce_scatter", full, flat=not hierarchical)
        if hierarchical:
            self._record_levels("reduce_scatter", full, self._int8("reduce_scatter", full))
            assert self.hier is not None
            return Handle([self.hier.reduce_scatter(full, out, accumulate)], None, self.stats, "reduce_scatter")
        shm = self._on_shm(full, out)
        if shm is not None:
            return self._shm_handle("reduce_scatter", shm, shm.reduce_scatter, full, out, accumulate)
        if self._int8("reduce_scatter", full):
            self._record_quantized("reduce_scatter", full)
            return self._quantized_reduce_scatter(full, out, accumulate)
        if route(Op.REDUCE_SCATTER, self.backend, full.device.type).primitive is Primitive.POINT_TO_POINT:
            return self._pairwise_reduce_scatter(full, out, accumulate)
        target = torch.empty_like(out) if accumulate else out
        work = dist.reduce_scatter_tensor(target, full, group=self.group, async_op=True)
        then = (lambda: out.add_(target)) if accumulate else None
        return Handle([work], then, self.stats, "reduce_scatter")

    def _pairwise_reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool) -> Handle:
        """Send each peer its piece of `full`, receive theirs of mine, sum in rank order (the same bits on every
        rank, shared memory's, and gloo's own with 2 ranks), then store the sum in `out`."""
        pieces = full.view(self.world_size, -1)
        received = {peer: torch.empty(pieces.shape[1], dtype=full.dtype) for peer in self._peers()}
        works = self._exchange(lambda peer: [pieces[peer]], lambda peer: [received[peer]])

        def then() -> None:
            parts = [received.get(r, pieces[self.rank]) for r in range(self.world_size)]
            total = torch.add(parts[0], parts[1], out=parts[1])  # never into a summand still to come
            for part in parts[2:]:
                total.add_(part)
            _store(out, total, accumulate)
        return Handle(works, then, self.stats, "reduce_scatter")

    def _quantized_reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool) -> Handle:
        """Each rank's piece sent to it as block int8 (quantize.py): a quarter of the bytes; the receiver adds the
        dequantized pieces and its own exact one in fp32, in rank order (the same bits on every rank, on either
        wire: point to point on gloo, one all-to-all on NCCL)."""
        pieces = full.view(self.world_size, -1)
        outbox = QuantizedRows.empty(self.world_size, pieces.shape[1], full.device)
        inbox = QuantizedRows.empty(self.world_size, pieces.shape[1], full.device)
        direct = not accumulate and out.dtype == torch.float32 and out.is_contiguous() and not _overlap(out, full)
        total = out if direct else torch.empty(pieces.shape[1], dtype=torch.float32, device=full.device)

        def quantize_chunk(lo: int, hi: int) -> None:
            for peer in self._peers():
                quantize(pieces[peer, lo:hi], _chunk(outbox, peer, lo, hi))

        def sum_chunk(lo: int, hi: int) -> None:
            part = total[lo:hi]
            for r in range(self.world_size):  # the first part written, the others added (no pass over zeros)
                if r == self.rank:
                    part.add_(pieces[r, lo:hi]) if r else part.copy_(pieces[r, lo:hi])
                else:
                    received = _chunk(inbox, r, lo, hi)
                    dequantize_add(received, part) if r else dequantize_into(received, part)
        works, finish = self._move_rows(Op.EXCHANGE, outbox, inbox, quantize_chunk, sum_chunk)
        store = None if direct else lambda: _store(out, total.to(out.dtype), accumulate)
        return Handle(works, _in_turn(finish, store), self.stats, "reduce_scatter")

    def _quantized_all_gather(self, full: torch.Tensor) -> Handle:
        """This rank's piece to every rank as block int8, every other piece from its rank; every piece, this
        rank's included, then holds the dequantized values (the same weights on every rank)."""
        pieces = full.view(self.world_size, -1)
        rows = QuantizedRows.empty(self.world_size, pieces.shape[1], full.device)

        def quantize_chunk(lo: int, hi: int) -> None:
            quantize(pieces[self.rank, lo:hi], _chunk(rows, self.rank, lo, hi))

        def dequantize_chunk(lo: int, hi: int) -> None:
            for r, piece in enumerate(pieces):
                dequantize_into(_chunk(rows, r, lo, hi), piece[lo:hi])
        works, finish = self._move_rows(Op.ALL_GATHER, rows, rows, quantize_chunk, dequantize_chunk)
        return Handle(works, finish, self.stats, "all_gather")

    def _move_rows(self, op: Op, outbox: QuantizedRows, inbox: QuantizedRows, quantize_chunk: Span,
                   finish_chunk: Span) -> tuple[list, Callable[[], None] | None]:
        """Quantize with `quantize_chunk(lo, hi)`, move rows between ranks by `op`'s wire (wire.py), and finish
        (dequantize, add) with `finish_chunk(lo, hi)` once elements [lo, hi) of every row have landed: an exchange
        sends row p of `outbox` to rank p, an all-gather this rank's row to every rank; row p of `inbox` comes
        from rank p. Returns the works to wait for, and what the waiter must run after them (None: nothing).

        Point to point (gloo), the rows go in chunks of CODEC_CHUNK elements on a thread of the codec's own: chunk
        c is quantized and sent while the chunks before it are on the wire, and each chunk is finished as soon as
        it has landed, between two chunks' quantizing (the thread waits for the wire only once everything is
        sent). Quantizing and dequantizing both hide under the link, and the training thread goes on computing
        meanwhile: finishing on the waiter's thread had taken that thread's CPU (`zerorun bench comm`'s
        caller's CPU column). The tags are taken here, on the caller's thread, so every rank numbers the
        transfers in the same order. On NCCL the device quantizes everything (a pass at memory speed), one
        collective moves each buffer, and the waiter finishes it all."""
        device = outbox.values.device.type
        if route(op, self.backend, device).primitive is not Primitive.POINT_TO_POINT:
            quantize_chunk(0, outbox.numel)
            finish = partial(finish_chunk, 0, outbox.numel)
            if op is Op.EXCHANGE:
                return [dist.all_to_all_single(received, sent, group=self.group, async_op=True)
                        for received, sent in ((inbox.values, outbox.values), (inbox.scales, outbox.scales))], finish
            return [dist.all_gather_into_tensor(buffer.view(-1), buffer[self.rank], group=self.group, async_op=True)
                    for buffer in (inbox.values, inbox.scales)], finish  # flat: a backend may cut an output by dim 0
        spans = [(lo, min(lo + CODEC_CHUNK, outbox.numel)) for lo in range(0, outbox.numel, CODEC_CHUNK)]
        tags = [[self._next_tag(), self._next_tag()] for _ in spans]

        def sent(peer: int, lo: int, hi: int) -> list[torch.Tensor]:
            return _chunk(outbox, peer if op is Op.EXCHANGE else self.rank, lo, hi).wire()

        def pipeline() -> None:
            in_flight: deque[tuple[list, tuple[int, int]]] = deque()
            for (lo, hi), chunk_tags in zip(spans, tags):
                quantize_chunk(lo, hi)
                in_flight.append((self._post(partial(sent, lo=lo, hi=hi), partial(_wire_of, inbox, lo=lo, hi=hi),
                                             chunk_tags), (lo, hi)))
                while in_flight and all(work.is_completed() for work in in_flight[0][0]):  # landed: finish it
                    _land(*in_flight.popleft(), finish_chunk)
            while in_flight:
                _land(*in_flight.popleft(), finish_chunk)
        if self._codec is None:
            self._codec = ThreadPoolExecutor(1, thread_name_prefix="zerorun-codec")
        return [FutureWork(self._codec.submit(pipeline))], None

    def _peers(self) -> list[int]:
        """The other ranks, each rank starting from its successor: no rank is everyone's first in line."""
        return [(self.rank + step) % self.world_size for step in range(1, self.world_size)]

    def _exchange(self, outgoing: Callable[[int], Sequence[torch.Tensor]],
                  incoming: Callable[[int], Sequence[torch.Tensor]]) -> list:
        """Point to point with every peer at once: `outgoing(peer)`'s tensors to it, `incoming(peer)`'s filled
        from it, the i-th of each under one tag. Each byte crosses once, in both directions at once; gloo's
        transport carries them directly instead of queueing collectives behind one another on its worker
        threads (an all-gather as one broadcast per owner ran at 80% of a real link, this at its floor)."""
        return self._post(outgoing, incoming, [self._next_tag() for _ in incoming(self._peers()[0])])

    def _post(self, outgoing: Callable[[int], Sequence[torch.Tensor]],
              incoming: Callable[[int], Sequence[torch.Tensor]], tags: list[int]) -> list:
        """`_exchange` with its tags already taken."""
        peers = self._peers()
        works = [dist.irecv(tensor, src=self._global(peer), group=self.group, tag=tag)
                 for peer in peers for tensor, tag in zip(incoming(peer), tags)]
        works += [dist.isend(tensor, dst=self._global(peer), group=self.group, tag=tag)
                  for peer in peers for tensor, tag in zip(outgoing(peer), tags)]
        return works

    def _next_tag(self) -> int:
        """A tag per point-to-point operation: every rank issues them in the same order, so tags match."""
        self._tag += 1
        return self._tag

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def all_gather(self, full: torch.Tensor, compute_copy: bool = False) -> Handle:
        """Fill `full` from every rank's piece; this rank's piece is already in place in `full`.

        `compute_copy`: `full` is only computed with, never stored back (stage 3's gathered unit; stages 1/2's flat
        parameters when their master is kept apart), so with `quantized_weights` it may travel as block int8
        (qwZ); every rank's piece, this one's included, then holds the dequantized values, so all ranks compute
        with the same weights."""
        if self.world_size == 1:
            self._record("all_gather", full)
            return Handle([], None, self.stats, "all_gather")
        if route(Op.ALL_GATHER, self.backend, full.device.type).staged:
            host = torch.empty(full.shape, dtype=full.dtype, pin_memory=torch.cuda.is_available())
            own = slice(self.rank * (full.numel() // self.world_size), (self.rank + 1) * (full.numel() // self.world_size))
            host.view(-1)[own].copy_(full.view(-1)[own])  # waits for the device's work on it, as any device-to-host copy
            return self._all_gather_on_wire(host, compute_copy).followed_by(lambda: full.copy_(host, non_blocking=True))
        return self._all_gather_on_wire(full, compute_copy)

    def _all_gather_on_wire(self, full: torch.Tensor, compute_copy: bool) -> Handle:
        """An all-gather of a tensor where the backend's wire reads it: hierarchical, else shared memory, else as
        block int8 (qwZ), else the wire's own."""
        hierarchical = self._hierarchical(full)
        self._record("all_gather", full, flat=not hierarchical)
        if hierarchical:
            self._record_levels("all_gather", full, self._int8("all_gather", full, compute_copy))
            assert self.hier is not None
            return Handle([self.hier.all_gather(full, compute_copy)], None, self.stats, "all_gather")
        shm = self._on_shm(full)
        if shm is not None:
            return self._shm_handle("all_gather", shm, shm.all_gather, full)
        pieces = full.view(self.world_size, -1)
        if self._int8("all_gather", full, compute_copy):
            self._record_quantized("all_gather", full)
            return self._quantized_all_gather(full)
        if route(Op.ALL_GATHER, self.backend, full.device.type).primitive is Primitive.POINT_TO_POINT:
            works = self._exchange(lambda peer: [pieces[self.rank]], lambda peer: [pieces[peer]])
            return Handle(works, None, self.stats, "all_gather")
        work = dist.all_gather_into_tensor(full, pieces[self.rank], group=self.group, async_op=True)
        return Handle([work], None, self.stats, "all_gather")

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Handle:
        if route(Op.BROADCAST, self.backend, tensor.device.type).staged:
            host = _to_host(tensor)
            return self.broadcast(host, src).followed_by(lambda: tensor.copy_(host, non_blocking=True))
        self._record("broadcast", tensor)
        shm = self._on_shm(tensor)
        if shm is not None and self.world_size > 1:
            return self._shm_handle("broadcast", shm, shm.broadcast, tensor, src)
        work = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        return Handle([work], None, self.stats, "broadcast")


def _chunk(rows: QuantizedRows, r: int, lo: int, hi: int) -> Quantized:
    """Elements [lo, hi) of row r (lo a multiple of BLOCK) as a `Quantized` of their own."""
    first, last = lo // BLOCK, -(-hi // BLOCK)
    return Quantized(rows.values[r, first * BLOCK:last * BLOCK].view(-1, BLOCK), rows.scales[r, first:last], hi - lo)


def _wire_of(rows: QuantizedRows, r: int, lo: int, hi: int) -> list[torch.Tensor]:
    return _chunk(rows, r, lo, hi).wire()


def _land(works: list, span: tuple[int, int], finish_chunk: Span) -> None:
    """Wait for one chunk's transfers, then finish its elements."""
    for work in works:
        work.wait()
    finish_chunk(*span)


def _in_turn(*steps: Callable[[], object] | None) -> Callable[[], None] | None:
    """One follow-up that runs `steps` in order (the Nones left out); None where there is nothing to run."""
    todo = [step for step in steps if step is not None]
    if not todo:
        return None

    def run() -> None:
        for step in todo:
            step()
    return run


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` in host memory (pinned where CUDA exists); returns once the copy is complete, so the
    device's work that wrote `tensor` is complete too."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    return host.copy_(tensor)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory may overlap (by address range: a conservative answer)."""
    a_end = a.data_ptr() + a.numel() * a.element_size()
    return a.data_ptr() < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < a_end


def _store(out: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.add_(value)
    else:
        out.copy_(value)
