"""The point-to-point wire of `Collectives`: pairwise reduce-scatter and all-gather, and ZeRO++'s block-int8 ones.

On gloo the reduce-scatter and the all-gather go pairwise, point to point (collectives.py says why): each rank sends
every other rank that rank's piece and receives theirs of its own, so each byte crosses the network once. The
quantized collectives (qgZ's reduce-scatter, qwZ's all-gather) are one algorithm over two wires: quantize, move the
int8 rows (point to point on gloo, chunk by chunk on a codec thread; one all-to-all or all-gather on NCCL), then
dequantize and sum in rank order, so every rank holds the same bits.

Gloo's TCP transport sends a point-to-point payload only once the receiver has said it posted the matching receive,
and that notice travels in the receiver's own outgoing queue on the pair's connection, behind whatever payload the
receiver is sending. So on one connection two exchanges in flight go in lockstep: rank 0 cannot start its piece of the
second until rank 1 has sent all of its piece of the first. Where the pieces differ (an owner-run unit's hold whole
matrices, 4.1M elements one way and 2.9M the other), the lighter direction of the link idles for the difference.
Where the payload crosses gloo's TCP, then, the exchanges take turns over `LANES` gloo groups of the world
(`lanes`): of `LANES` consecutive exchanges no two share a connection, so the receiver's notice for the next one is
not queued behind its payload of the last one (it can still wait in the link's own queue, which the connections
share: the lockstep is shortened, not gone; docs/optimizers.md has the measurement).

`Collectives` inherits these; what routes a call here (the wire table, shared memory, the hierarchy) stays there.
"""

from __future__ import annotations

import datetime
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.runtime.comm.dist import joined
from zerorun.runtime.comm.handles import CommStats, FutureWork, Handle
from zerorun.runtime.comm.quantize import BLOCK, Quantized, QuantizedRows, dequantize_add, dequantize_into, quantize
from zerorun.runtime.comm.wire import Op, Primitive, route

# exchanges that may be in flight at once without sharing a connection: stage 3 gathers two units ahead, each up to
# two collectives (a Muon unit and the small AdamW one of the same block); over the emulated 1 Gbit/s link 2 and 8
# did no better (docs/optimizers.md)
LANES = 4
CODEC_CHUNK = 256 * BLOCK  # elements quantized at once on the point-to-point wire: 2 MiB of fp32, 0.5 MiB sent
Span = Callable[[int, int], None]  # work on elements [lo, hi) of every row


class PointToPoint:
    """Collectives over isend/irecv between every pair of ranks (and the quantized ones, whatever the wire)."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    backend: str
    stats: CommStats

    def __init__(self) -> None:
        self._p2p_tag = 0  # the last point-to-point tag taken: every rank takes them in the same order
        self.lanes: list[dist.ProcessGroup] = []  # the exchanges' connections over a network, taken in turn (above)
        self._turn = 0
        self._codec: ThreadPoolExecutor | None = None  # quantized point-to-point collectives: made at first use

    def _pairwise_reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool,
                                 used: Sequence[int] | None = None) -> Handle:
        """Send each peer its piece of `full`, receive theirs of mine, sum in rank order (the same bits on every
        rank, shared memory's, and gloo's own with 2 ranks), then store the sum in `out`. `used`: per rank, the
        start of its piece that carries values (only that travels; the rest of `out` is zero, or left accumulating)."""
        pieces = full.view(self.world_size, -1)
        n = used or [pieces.shape[1]] * self.world_size
        mine = n[self.rank]
        received = {peer: torch.empty(mine, dtype=full.dtype) for peer in self._peers()}
        works = self._exchange(lambda peer: [pieces[peer, :n[peer]]], lambda peer: [received[peer]])

        def then() -> None:
            parts = [received.get(r, pieces[self.rank, :mine]) for r in range(self.world_size)]
            total = torch.add(parts[0], parts[1], out=parts[1])  # never into a summand still to come
            for part in parts[2:]:
                total.add_(part)
            store_into(out[:mine], total, accumulate)
            if mine < out.numel() and not accumulate:
                out[mine:].zero_()
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
        store = None if direct else lambda: store_into(out, total.to(out.dtype), accumulate)
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
        tags = [self._next_tag() for _ in incoming(self._peers()[0])]
        if not self.lanes:
            return self._post(outgoing, incoming, tags)
        self._turn = (self._turn + 1) % len(self.lanes)
        return self._post(outgoing, incoming, tags, self.lanes[self._turn])

    def _post(self, outgoing: Callable[[int], Sequence[torch.Tensor]],
              incoming: Callable[[int], Sequence[torch.Tensor]], tags: list[int],
              lane: dist.ProcessGroup | None = None) -> list:
        """`_exchange` with its tags already taken, on `lane` (None: the group's own connections)."""
        peers = self._peers()
        group = self.group if lane is None else lane
        works = [dist.irecv(tensor, src=self._global(peer), group=group, tag=tag)
                 for peer in peers for tensor, tag in zip(incoming(peer), tags)]
        works += [dist.isend(tensor, dst=self._global(peer), group=group, tag=tag)
                  for peer in peers for tensor, tag in zip(outgoing(peer), tags)]
        return works

    def _next_tag(self) -> int:
        """A tag per point-to-point operation: every rank issues them in the same order, so tags match."""
        self._p2p_tag += 1
        return self._p2p_tag

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


def make_lanes(timeout_s: float) -> list[dist.ProcessGroup]:
    """`LANES` gloo groups of the whole world, for the exchanges to take in turn (every rank makes the same calls, as
    `dist.new_group` requires). `ZERORUN_WIRE_LANES` overrides the count (1: the group's own connections only)."""
    setting = os.environ.get("ZERORUN_WIRE_LANES", str(LANES))
    if not setting.isdigit() or int(setting) < 1:
        raise ZerorunError(f"ZERORUN_WIRE_LANES={setting!r}: expected a whole number of connections, 1 or more "
                           f"(1: every exchange on the group's own; unset: {LANES}).")
    count, timeout = int(setting), datetime.timedelta(seconds=timeout_s)
    return [joined(dist.new_group(backend="gloo", timeout=timeout)) for _ in range(count if count > 1 else 0)]


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


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' memory may overlap (by address range: a conservative answer)."""
    a_end = a.data_ptr() + a.numel() * a.element_size()
    return a.data_ptr() < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < a_end


def store_into(out: torch.Tensor, value: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        out.add_(value)
    else:
        out.copy_(value)
