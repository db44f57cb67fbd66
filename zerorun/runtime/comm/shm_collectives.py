"""Collectives for CPU ranks on one host, through a shared-memory segment instead of gloo's TCP loopback.

Gloo moves every byte through a loopback socket (kernel copies both ways, a few GB/s at best); ranks
on one host can instead read each other's data from a segment every rank maps. Each operation goes
chunk by chunk through the segment: every rank writes its data into its own slot, the ranks meet,
then each reads what it needs from the others' slots. The segment has two halves used in turn, so
one meeting per chunk is enough: a rank writes a half again only after everyone has passed the
meeting that follows their reads of it.

Operations run on one worker thread per process, in the order they were issued: a call returns at
once with a future, and the caller waits only where it needs the result, so a rank that arrives
early keeps computing instead of waiting for its peers (what gloo's own threads give).

Sums are taken in rank order (slot 0 + slot 1 + ...) on every rank, so all ranks hold the same bits
and, with 2 ranks, the same bits as gloo's sum.

The meeting is a counter per rank in the segment's header: a rank publishes how many meetings it
has reached and sleeps on each peer's counter (a futex) until it has too. x86 keeps stores in
order, so data written before a counter is visible to whoever sees the counter; elsewhere the
meeting is a gloo barrier (milliseconds, against microseconds). A rank that waits longer than the
collective timeout, or sees a peer's process gone, raises naming that rank: never a hang.

Every operation carries its caller's tag (tags.py): each rank writes it into the header before the operation's
first meeting and compares everyone's after it, before reading a slot, so ranks at different collectives stop
there instead of reading each other's data.

The segment lives in /dev/shm only while the ranks open it: once everyone has mapped it, rank 0
unlinks it, so nothing is left behind whatever happens next; a rank killed before that leaves it, and
the node supervisor removes the job's segments by their name (`zerorun.jobs.shm_prefix`: the job id). Space is reserved up front
(`posix_fallocate`), so a full /dev/shm is a fallback to gloo at start, never a SIGBUS mid-step.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import secrets
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Literal, Sequence

import numpy
import torch
import torch.distributed as dist

from zerorun.errors import ZerorunError
from zerorun.jobs import JOB_ID_ENV, SHM_DIR, shm_prefix
from zerorun.runtime.comm.dist import joined
from zerorun.runtime.comm.places import WORDS, DesyncError, Tag, UnitNames, check_agree

log = logging.getLogger("zerorun")
CpuCollectives = Literal["auto", "shm", "gloo"]

SLOT_BYTES = 2 * 2**20  # per rank and half: many times a meeting's cost, and 8 MiB in all for 2 ranks
SEGMENT_BYTES = 32 * 2**20  # at most, whatever the rank count (Docker's default /dev/shm is 64 MiB)
COUNTER_BYTES = 64 * 2**10  # a 64-byte line per rank's meeting counter (up to 1024 ranks)
TAG_LINE = 2 * WORDS  # int64 words per rank and parity: the tag's words, then the operation's position
HEADER_BYTES = COUNTER_BYTES + 2 * 1024 * TAG_LINE * 8  # then each rank's tag, for even and odd operations
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")  # and the futex syscall number is x86-64's
_SUMMABLE = {dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX, dist.ReduceOp.MIN}


class Unavailable(Exception):
    """Shared memory cannot carry this group's collectives; the message says why."""


class ShmCollectives:
    """All-reduce, reduce-scatter, all-gather and broadcast among the ranks of `group`, all on this host."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int,
                 slot_bytes: int | None = None, timeout_s: float = 300.0) -> None:
        slot_bytes = slot_bytes or min(SLOT_BYTES, SEGMENT_BYTES // (2 * world_size) // 4096 * 4096)
        assert slot_bytes >= 8 * world_size, "a slot holds at least one 8-byte element per rank"
        assert world_size * 64 <= COUNTER_BYTES, "one header line per rank"
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        mapped = _map_segment(group, rank, HEADER_BYTES + 2 * world_size * slot_bytes)
        self._header, self._segment = mapped[:HEADER_BYTES], mapped[HEADER_BYTES:]
        self.board = TagBoard(mapped[COUNTER_BYTES:HEADER_BYTES], rank, world_size)
        pids: list[int] = [0] * world_size
        dist.all_gather_object(pids, os.getpid(), group=group)
        if ORDERED_STORES:
            self._rendezvous: Callable[[], None] = _Meeting(self._header, rank, pids, timeout_s)
        else:
            barrier_group = joined(dist.new_group(None if group is None else dist.get_process_group_ranks(group),
                                                  backend="gloo"))
            def meet() -> None:
                dist.barrier(group=barrier_group)
            self._rendezvous = meet
        self._half = 0
        # one thread runs every operation, in the order they were issued (the same on every rank), so
        # the caller goes on computing while its rank waits for the others, as with gloo's own threads
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="zerorun-shm")
        self._failed: Exception | None = None  # the first operation's error: the ranks' meetings are out of step since

    def submit(self, fn: Callable[..., None], *args: object, tag: Tag | None = None,
               names: UnitNames | None = None) -> Future:
        """Run `fn(*args)` (one of the operations below) after every operation issued before it; with `tag`, only
        once every rank's operation at this place in the queue has the same tag (`names` words the mismatch)."""
        return self._worker.submit(self._run, fn, tag, names, *args)

    def _run(self, fn: Callable[..., None], tag: Tag | None, names: UnitNames | None, *args: object) -> None:
        """Operations queued behind a failed one fail at once, naming it, instead of each waiting out the
        timeout (which kept a failed rank alive, in the interpreter's exit, for a timeout per queued one); ranks
        that disagree get the very error that stopped the first."""
        if isinstance(self._failed, DesyncError):
            raise self._failed
        if self._failed is not None:
            raise RuntimeError(f"shared-memory collective not run: an earlier one failed ({self._failed})")
        try:
            self.board.post(tag, names)
            fn(*args)
            if self.board.pending:  # an operation on nothing still meets once: its tag is checked too
                self._meet()
        except Exception as err:
            self._failed = err
            raise
        finally:
            self.board.done()  # the segment outlives engines: it keeps no reference to one

    # -- the meeting and the slots ----------------------------------------------------------------
    def _meet(self) -> None:
        """Wait for every rank; the operation's first meeting then compares every rank's tag."""
        self._rendezvous()
        self.board.check()

    def barrier(self) -> None:
        """Only a meeting (with a tag: a check that every rank is at the same place)."""
        self._meet()

    def _slots(self, dtype: torch.dtype) -> torch.Tensor:
        """The half to use next, as [world_size, slot elements] of `dtype`; the next call gets the other."""
        half = self._segment.view(2, self.world_size, self.slot_bytes)[self._half]
        self._half ^= 1
        return half.view(dtype)

    def _chunks(self, numel: int, per_chunk: int) -> range:
        return range(0, numel, per_chunk)

    # -- the operations -----------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        """`tensor` reduced in place; every rank ends with the same bits."""
        flat = tensor.view(-1)
        per = self.slot_bytes // tensor.element_size()
        for start in self._chunks(flat.numel(), per):
            piece = flat[start:start + per]
            slots = self._slots(tensor.dtype)[:, :piece.numel()]
            slots[self.rank].copy_(piece)
            self._meet()
            _reduce_into(piece, [slots[q] for q in range(self.world_size)], op)

    def reduce_scatter(self, full: torch.Tensor, out: torch.Tensor, accumulate: bool,
                       used: Sequence[int] | None = None) -> None:
        """The sum of every rank's `full`, this rank's piece of it into `out` (or added to it). `used`: per rank, the
        start of its piece that carries values; only that moves, and the rest of `out` is zero (or left as it is)."""
        pieces = full.view(self.world_size, -1)
        n = used or [pieces.shape[1]] * self.world_size
        per = self.slot_bytes // full.element_size() // self.world_size
        scratch = torch.empty(min(per, out.numel()), dtype=out.dtype) if accumulate else None
        # the pieces the others read go through the slot; this rank's own is read in place, unless `out` is
        # that very piece (an in-place reduce-scatter) and the sum would overwrite it before reading it
        # (summands from the third on are added into `out`)
        in_place = self.rank >= 2 and out.untyped_storage().data_ptr() == full.untyped_storage().data_ptr()
        for start in self._chunks(max(n), per):  # every rank meets as often: over the longest piece
            end = min(start + per, max(n))
            slots = self._slots(full.dtype)[:, :self.world_size * (end - start)].view(self.world_size, self.world_size, -1)
            for q in range(self.world_size):
                if (q != self.rank or in_place) and start < n[q]:
                    hi = min(end, n[q])
                    slots[self.rank, q, :hi - start].copy_(pieces[q, start:hi])
            self._meet()
            hi = min(end, n[self.rank])
            if start >= hi:
                continue
            mine = [slots[q, self.rank, :hi - start] if q != self.rank or in_place else pieces[q, start:hi]
                    for q in range(self.world_size)]
            if scratch is None:
                _reduce_into(out[start:hi], mine, dist.ReduceOp.SUM)
            else:
                total = scratch[:hi - start]
                _reduce_into(total, mine, dist.ReduceOp.SUM)
                out[start:hi].add_(total)
        if n[self.rank] < out.numel() and not accumulate:
            out[n[self.rank]:].zero_()

    def all_gather(self, full: torch.Tensor, used: Sequence[int] | None = None) -> None:
        """Every rank's piece of `full` (its own already in place) into every rank's `full`. `used`: per rank, the
        start of its piece that carries values; only that moves (the rest of the others' pieces is left as it is)."""
        pieces = full.view(self.world_size, -1)
        n = used or [pieces.shape[1]] * self.world_size
        per = self.slot_bytes // full.element_size()
        for start in self._chunks(max(n), per):
            end = min(start + per, max(n))
            slots = self._slots(full.dtype)[:, :end - start]
            if start < n[self.rank]:
                hi = min(end, n[self.rank])
                slots[self.rank, :hi - start].copy_(pieces[self.rank, start:hi])
            self._meet()
            for q in range(self.world_size):
                if q != self.rank and start < n[q]:
                    hi = min(end, n[q])
                    pieces[q, start:hi].copy_(slots[q, :hi - start])

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        flat = tensor.view(-1)
        per = self.slot_bytes // tensor.element_size()
        for start in self._chunks(flat.numel(), per):
            piece = flat[start:start + per]
            slot = self._slots(tensor.dtype)[src, :piece.numel()]
            if self.rank == src:
                slot.copy_(piece)
            self._meet()
            if self.rank != src:
                piece.copy_(slot)

    @staticmethod
    def handles(op: dist.ReduceOp.RedOpType) -> bool:
        """Whether `op` is one this transport reduces (others go through the process group)."""
        return op in _SUMMABLE


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Meeting:
    """Ranks meet through one counter per rank (a 64-byte line each) in the shared header.

    A rank counts its arrival and wakes whoever sleeps on its counter; then, for each peer not there
    yet, it sleeps in the kernel on that peer's counter (a futex on shared memory: no core spent
    waiting, woken within microseconds of the peer's arrival), waking now and then to see whether
    the peer's process is gone or the collective timeout has passed.
    """

    FUTEX_WAIT, FUTEX_WAKE, SYS_FUTEX = 0, 1, 202  # x86-64 Linux

    def __init__(self, header: torch.Tensor, rank: int, pids: list[int], timeout_s: float) -> None:
        self._header = header  # keeps the mapping alive under the counters
        self.rank, self.pids, self.timeout_s = rank, pids, timeout_s
        self.addresses = [header.data_ptr() + 64 * q for q in range(len(pids))]
        self.counters = [ctypes.c_int32.from_address(a) for a in self.addresses]
        self.reached = 0
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall
        self._syscall.restype = ctypes.c_long
        self._tick = _Timespec(0, 100_000_000)

    def __call__(self) -> None:
        self.reached = (self.reached + 1) & 0x7FFFFFFF
        self.counters[self.rank].value = self.reached
        self._syscall(self.SYS_FUTEX, ctypes.c_void_p(self.addresses[self.rank]), self.FUTEX_WAKE, 0x7FFFFFFF,
                      None, None, 0)
        for q, counter in enumerate(self.counters):
            started = None
            while True:
                seen = counter.value
                if (seen - self.reached) & 0x7FFFFFFF < 0x40000000:  # seen >= reached, modulo the wrap
                    break
                self._syscall(self.SYS_FUTEX, ctypes.c_void_p(self.addresses[q]), self.FUTEX_WAIT, seen,
                              ctypes.byref(self._tick), None, 0)
                started = started or time.monotonic()
                self._check(q, time.monotonic() - started)

    def _check(self, q: int, waited: float) -> None:
        try:
            os.kill(self.pids[q], 0)
        except ProcessLookupError:
            raise RuntimeError(f"shared-memory collective: rank {q} (pid {self.pids[q]}) exited while this rank "
                               f"waited for it") from None
        except PermissionError:
            pass
        if waited > self.timeout_s:
            raise RuntimeError(f"shared-memory collective: rank {q} did not arrive within {waited:.0f} s "
                               f"(the collective timeout, launch.timeout_s)")


class TagBoard:
    """Each rank's tag for its current operation, in the segment's header (an even and an odd line per rank).

    A rank writes operation p's tag into line p % 2 before p's first meeting. Nobody writes line p % 2 again before
    everyone has passed operation p + 1's first meeting, by which time everyone has read p's tags. The lines are
    compared as raw words through a numpy view (microseconds: this runs on every collective); only a mismatch
    decodes them into tags to say where each rank was.
    """

    def __init__(self, region: torch.Tensor, rank: int, world_size: int) -> None:
        self._lines = region.numpy().view(numpy.int64).reshape(2, -1, TAG_LINE)[:, :world_size, :WORDS + 1]
        self.rank, self.world_size = rank, world_size
        self.position = 0  # operations this rank has run (tagged or not): the same count on every rank
        self.pending: Tag | None = None  # this operation's tag, until its first meeting has checked it
        self._names: UnitNames | None = None

    def post(self, tag: Tag | None, names: UnitNames | None) -> None:
        """Before an operation: count it, and write its tag (and its position) where the peers read it."""
        self.position += 1
        self.pending, self._names = tag, names
        if tag is not None:
            self._lines[self.position % 2, self.rank] = [*tag.words(), self.position]

    def done(self) -> None:
        self.pending, self._names = None, None

    def check(self) -> None:
        """After a meeting: the first one of a tagged operation compares every rank's tag (raises on a mismatch)."""
        if self.pending is None:
            return
        self.pending = None
        lines = self._lines[self.position % 2]
        if (lines == lines[self.rank]).all():
            return
        tags = [Tag.from_words(row[:WORDS]) if row[WORDS] == self.position else None for row in lines.tolist()]
        assert self._names is not None, "a tagged operation names its units"
        check_agree(tags, self._names)


def _reduce_into(out: torch.Tensor, parts: list[torch.Tensor], op: dist.ReduceOp.RedOpType) -> None:
    """`out` = parts[0] (op) parts[1] (op) ..., left to right, the same order on every rank."""
    combine: Callable[..., torch.Tensor] = {dist.ReduceOp.MAX: torch.maximum,
                                            dist.ReduceOp.MIN: torch.minimum}.get(op, torch.add)
    if len(parts) == 1:
        out.copy_(parts[0])
    else:
        combine(parts[0], parts[1], out=out)
        for part in parts[2:]:
            combine(out, part, out=out)
    if op == dist.ReduceOp.AVG:
        out.div_(len(parts))


def _map_segment(group: dist.ProcessGroup | None, rank: int, nbytes: int) -> torch.Tensor:
    """A segment of `nbytes` every rank of `group` maps; raises `Unavailable` on every rank if any cannot."""
    name = [f"{shm_prefix(os.environ.get(JOB_ID_ENV))}{os.getpid()}-{secrets.token_hex(6)}" if rank == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    segment_name = name[0]
    assert segment_name is not None, "rank 0 names the segment"
    path = os.path.join(SHM_DIR, segment_name)
    segment, problem = None, None
    try:
        if rank == 0:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, nbytes)  # reserved now: no SIGBUS from a full /dev/shm later
            finally:
                os.close(fd)
    except OSError as err:
        problem = f"cannot reserve {nbytes / 2**20:.0f} MiB in {SHM_DIR} ({err.strerror})"
    problems = [problem]
    dist.broadcast_object_list(problems, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    if problems[0] is None:
        try:
            if rank != 0:  # the file must already be there: from_file would create one on another host
                os.close(os.open(path, os.O_RDWR))
            segment = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            token = segment[-8:]  # in the slots, never in the meeting counters
            if rank == 0:
                token.copy_(torch.frombuffer(bytearray(segment_name[-8:].encode()), dtype=torch.uint8))
        except (OSError, RuntimeError) as err:
            problem = f"cannot map {path} ({err})"
    everyone: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, problems[0] or problem, group=group)
    if all(p is None for p in everyone):  # rank 0's token read back everywhere: truly the same segment
        assert segment is not None, "every rank mapped the segment"
        seen = bytes(segment[-8:].tolist()) == segment_name[-8:].encode()
        everyone = [None] * len(everyone)
        dist.all_gather_object(everyone, None if seen else "a different /dev/shm (another host or container)",
                               group=group)
    if rank == 0:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    failed = [f"rank {q}: {p}" for q, p in enumerate(everyone) if p is not None]
    if failed:
        raise Unavailable("; ".join(failed))
    assert segment is not None
    return segment


class Segments:
    """A runtime's segments (runtime/context.py), one per process group, whatever the number of engines over it:
    every rank of a group maps the same file, in the order the group's collectives are built."""

    def __init__(self) -> None:
        self._by_group: dict[dist.ProcessGroup, ShmCollectives] = {}

    def of(self, group: dist.ProcessGroup) -> ShmCollectives | None:
        return self._by_group.get(group)

    def add(self, group: dist.ProcessGroup, segment: ShmCollectives) -> ShmCollectives:
        self._by_group[group] = segment
        return segment

    def close(self) -> None:
        """Let go of every segment (a rank thread's groups end with it; a process's, with the process)."""
        self._by_group.clear()


def host_contiguous(tensors: tuple[torch.Tensor, ...]) -> bool:
    """What the shared-memory and hierarchical paths can carry: contiguous tensors on the CPU."""
    return all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)


def shared_memory(group: dist.ProcessGroup | None, rank: int, world_size: int, backend: str,
                   setting: CpuCollectives, timeout_s: float, segments: Segments) -> ShmCollectives | None:
    """The shared-memory transport where `setting` asks for it and every rank of the group can map it (the group's
    segment in `segments`, made the first time)."""
    if setting == "gloo" or world_size == 1:
        return None
    if backend != "gloo":
        if setting == "shm":
            raise ZerorunError(f"zero.cpu_collectives: shm carries CPU ranks' collectives; this job's backend is "
                               f"{backend}. Use auto (shm only where ranks are on CPU) or gloo.")
        return None
    key = group or dist.group.WORLD  # a re-initialised process group gets a segment of its own
    assert key is not None  # the default group exists once the process group is initialised
    known = segments.of(key)
    if known is not None:
        return known
    try:
        return segments.add(key, ShmCollectives(group, rank, world_size, timeout_s=timeout_s))
    except Unavailable as why:
        if setting == "shm":
            raise ZerorunError(f"zero.cpu_collectives: shm is not possible here: {why}. Use auto (falls back to "
                               f"gloo) or gloo.") from None
        if rank == 0:
            log.warning("zerorun: collectives go through gloo, not shared memory: %s", why)
        return None
